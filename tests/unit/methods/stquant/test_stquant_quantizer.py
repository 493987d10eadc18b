"""STQuant's blockwise quantizers against float64 brute force: error bounds per width (linear
and log), the nearest grid point, packed storage, zeros, extremes, shards and idempotence."""

import math

import pytest
import torch

from megatron_ext.methods.stquant.quantizer import LOG_STEP, QState, dequantize, quantize

BLOCK = 64


def heavy_tailed(n: int, seed: int) -> torch.Tensor:
    """Values over ~6 decades, like Adam's moments."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_linear_error_is_at_most_half_a_step_and_nearest(bits):
    x = heavy_tailed(64 * 40, seed=bits)
    got = dequantize(quantize(x, "linear", bits, BLOCK)).double()
    blocks = x.double().view(-1, BLOCK)
    top = 2 ** (bits - 1) - 1
    step = blocks.abs().amax(dim=1, keepdim=True) / top  # float64 reference
    err = (got.view(-1, BLOCK) - blocks).abs()
    assert (err <= step / 2 * (1 + 1e-6)).all()
    if bits == 4:  # brute force: no grid point q*s, |q| <= 7, is nearer
        grid = torch.arange(-top, top + 1, dtype=torch.float64) * step[:, :, None]
        nearest = (blocks[:, :, None] - grid).abs().amin(dim=2)
        assert ((err - nearest).abs() <= step * 1e-5).all()  # fp32 rounding at midpoints


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_log_relative_error_inside_the_ladder_and_rounds_up_below_it(bits):
    v = heavy_tailed(64 * 40, seed=10 + bits).square()
    got = dequantize(quantize(v, "log", bits, BLOCK)).double().view(-1, BLOCK)
    ref = v.double().view(-1, BLOCK)
    vmax = ref.amax(dim=1, keepdim=True)
    step = LOG_STEP[bits]
    lowest = vmax * 2.0 ** ((1 - (2 ** bits - 1)) * step)
    inside = ref >= lowest
    ratio = (got / ref)[inside].log2().abs()
    assert ratio.max() <= step / 2 + 1e-5
    below = ~inside
    if bits == 4:
        assert below.any()  # the data reach below 14 octaves: the clamp is exercised
    assert torch.allclose(got[below], lowest.expand_as(got)[below], rtol=1e-5)
    assert (got[below] >= ref[below]).all()
    assert (got.amax(dim=1, keepdim=True) == vmax).all()  # the top code is exactly vmax


@pytest.mark.parametrize("mode", ["linear", "log"])
@pytest.mark.parametrize("bits", [4, 8, 16, 32])
def test_zero_stays_exactly_zero(mode, bits):
    x = heavy_tailed(256, seed=3).abs()
    x[::3] = 0.0
    x[128:192] = 0.0  # an all-zero block: scale 0, no division by zero
    got = dequantize(quantize(x, mode, bits, BLOCK))
    assert (got[x == 0] == 0).all() and not torch.signbit(got[x == 0]).any()
    assert (got[x > 0] > 0).all() or mode == "linear"


@pytest.mark.parametrize("mode", ["linear", "log"])
@pytest.mark.parametrize("bits", [4, 8, 16])
def test_extremes_stay_finite(mode, bits):
    tiny = torch.finfo(torch.float32).tiny
    x = torch.tensor([3.0e38, 1e-45, tiny, 1.0, 0.0, 1e-30, 2.9e38, 5.0] * 8)
    got = dequantize(quantize(x, mode, bits, 8))
    assert torch.isfinite(got).all()
    if mode == "log":
        assert (got[x > 0] > 0).all()


@pytest.mark.parametrize("mode", ["linear", "log"])
@pytest.mark.parametrize("bits", [4, 8, 16])
def test_packed_storage_is_exactly_b_bits_per_element_and_round_trips(mode, bits):
    x = heavy_tailed(64 * 16, seed=bits).abs()
    q = quantize(x, mode, bits, BLOCK)
    assert q.codes.numel() * q.codes.element_size() == x.numel() * bits // 8
    assert q.scales.dtype == torch.float32 and q.scales.numel() == 16
    saved = QState.from_dict({k: v.clone() if torch.is_tensor(v) else v
                              for k, v in q.to_dict().items()})
    assert torch.equal(dequantize(saved), dequantize(q))


def test_four_bit_log_codes_two_per_byte_low_nibble_first():
    v = torch.tensor([1.0, 0.25, 0.0, 2.0 ** -20] + [0.5] * 60)
    q = quantize(v, "log", 4, BLOCK)
    # by hand, vmax = 1, δ = 1: k = 15 + log2(v), clamped to [1, 15]; 0 for v = 0
    k = [15, 13, 0, 1]
    assert q.codes[0, 0].item() == k[0] | (k[1] << 4)
    assert q.codes[0, 1].item() == k[2] | (k[3] << 4)


def test_state_bytes_are_codes_plus_float32_scales():
    x = heavy_tailed(4096, seed=5)
    assert quantize(x, "linear", 4, 64).nbytes() == 4096 // 2 + 64 * 4
    assert quantize(x, "log", 8, 128).nbytes() == 4096 + 32 * 4
    assert quantize(x, "log", 16, 64).nbytes() == 4096 * 2 + 64 * 4
    assert quantize(x, "linear", 32, 64).nbytes() == 4096 * 4


@pytest.mark.parametrize("mode", ["linear", "log"])
def test_a_shard_on_the_block_grid_quantizes_like_the_whole(mode):
    x = heavy_tailed(64 * 10, seed=7).abs()
    whole = dequantize(quantize(x, mode, 4, BLOCK))
    shard = dequantize(quantize(x[128:448], mode, 4, BLOCK, lead=0))
    assert torch.equal(whole[128:448], shard)
    # off the grid: the shard's first block is cut at the shard start, the bound still holds
    part = quantize(x[100:448], mode, 4, BLOCK, lead=100 % BLOCK)
    assert part.scales.numel() == math.ceil((36 + 348) / BLOCK)
    got = dequantize(part)
    assert torch.equal(got[28:], whole[128:448])  # whole blocks agree exactly


@pytest.mark.parametrize("mode", ["linear", "log"])
@pytest.mark.parametrize("bits", [4, 8, 16])
def test_requantizing_the_dequantized_state_gives_the_same_codes(mode, bits):
    x = heavy_tailed(64 * 12 + 20, seed=bits).abs()
    first = quantize(x, mode, bits, BLOCK, lead=12)
    again = quantize(dequantize(first), mode, bits, BLOCK, lead=12)
    assert torch.equal(first.codes, again.codes)
    assert torch.allclose(first.scales, again.scales, rtol=1e-6, atol=0)


def test_32_bits_is_the_float32_tensor_and_the_dict_round_trips():
    x = heavy_tailed(100, seed=1)
    q = quantize(x, "log", 32, BLOCK)
    assert torch.equal(dequantize(q), x) and q.scales is None
    q4 = quantize(x.abs(), "log", 4, BLOCK, lead=4)
    assert torch.equal(dequantize(QState.from_dict(q4.to_dict())), dequantize(q4))


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "cubic", "bits": 4}, "mode"), ({"mode": "log", "bits": 6}, "bits"),
    ({"mode": "log", "bits": 4, "lead": 64}, "lead"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize(torch.ones(8), block=BLOCK, **kwargs)


def _log_codes(q: QState) -> torch.Tensor:
    """The rung numbers ``k`` of a logarithmic QState, ``(blocks, B)``."""
    from megatron_ext.formats.codes import unpack_nibbles
    if q.bits == 16:
        return q.codes.long() + 2 ** 15
    return (unpack_nibbles(q.codes, q.block) if q.bits == 4 else q.codes).long()


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_log_codes_are_the_exact_nearest_rung(bits):
    """k = round(K + log2(v / vmax) / δ) computed in float64, on heavy-tailed values and on
    the float32 values either side of every rung midpoint of the ladder's top 3 octaves
    (where a float32 log2 would decide wrongly), with the block maximum 1."""
    top, step = 2 ** bits - 1, LOG_STEP[bits]
    per, octaves = round(1 / step), min(3, math.ceil((top - 1) * step))
    mids = torch.exp2(-(torch.arange(per * octaves, dtype=torch.float64) + 0.5) * step)
    above = mids.float()
    above = torch.where(above.double() < mids, torch.nextafter(above, torch.tensor(2.0)), above)
    below = torch.nextafter(above, torch.tensor(0.0))
    edge = torch.cat([above, below])
    x = torch.cat([heavy_tailed(64 * 40, seed=bits).square(), edge])
    x = torch.cat([x, torch.ones(-x.numel() % BLOCK)]).view(-1, BLOCK)
    x[-(edge.numel() // BLOCK + 2):, 0] = 1.0  # the edge blocks' maximum is 1
    q = quantize(x.view(-1), "log", bits, BLOCK)
    vmax = x.amax(dim=1, keepdim=True)
    ratio = (x / vmax).clamp(min=torch.finfo(torch.float32).tiny).double()
    want = torch.round(top + torch.log2(ratio) / step).clamp(1, top)
    assert torch.equal(_log_codes(q), torch.where(x > 0, want, 0).long())
