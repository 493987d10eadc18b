"""STQuant's checkpoint slices put together at another DP size (checkpoint.assemble): bit for bit
where the blocks are the same (DP 2 <-> DP 1, megatron's ranges on multiples of 64), requantized
within half the new scale where a range cuts a block (DP 4: multiples of 32), float32 state
and main copies concatenated; a gap and the earlier per-rank format refused in one line."""

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.methods.stquant.checkpoint import assemble, saved_header
from megatron_ext.methods.stquant.quantizer import dequantize, quantize

BLOCK = 64
NUMEL = 1000  # not a multiple of the block: the last block is partial in every layout
DP2 = [(0, 512), (512, NUMEL)]  # megatron's ranges for DP 2: multiples of 64
DP4 = [(0, 288), (288, 576), (576, 864), (864, NUMEL)]  # DP 4: multiples of 32


def moments(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m and v of one parameter, over ~6 decades like Adam's (some exact zeros)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(NUMEL, generator=g) * torch.exp(2 * torch.randn(NUMEL, generator=g))
    v = (torch.randn(NUMEL, generator=g) * torch.exp(2 * torch.randn(NUMEL, generator=g))) ** 2
    m[::17], v[::17] = 0.0, 0.0
    return m, v


def slices(m, v, ranges, bits: int, main=None) -> list[dict]:
    """What each rank of a layout saves: its range quantized on the parameter's grid."""
    return [{"range": [s, e], "step": torch.tensor(3.0),
             "exp_avg": quantize(m[s:e], "linear", bits, BLOCK, s % BLOCK).to_dict(),
             "exp_avg_sq": quantize(v[s:e], "log", bits, BLOCK, s % BLOCK).to_dict(),
             "main": None if main is None else main[s:e]} for s, e in ranges]


def same_codes(a, b) -> bool:
    return (a.bits, a.lead, a.numel) == (b.bits, b.lead, b.numel) and torch.equal(
        a.codes, b.codes) and (a.scales is None or torch.equal(a.scales, b.scales))


@pytest.mark.parametrize("bits", [4, 8, 16, 32])
def test_dp2_to_dp1_and_back_is_bit_exact(bits):
    m, v = moments(bits)
    saved2 = slices(m, v, DP2, bits)
    saved1 = slices(m, v, [(0, NUMEL)], bits)
    full = assemble(saved2, 0, NUMEL, BLOCK)
    one = {n: quantize(x, mode, bits, BLOCK) for n, x, mode in
           (("exp_avg", m, "linear"), ("exp_avg_sq", v, "log"))}
    for name in ("exp_avg", "exp_avg_sq"):
        assert same_codes(full[name], one[name])  # as if saved at DP 1
        for (s, e), piece in zip(DP2, saved2):
            got = assemble(saved1, s, e, BLOCK)[name]
            assert same_codes(got, assemble([piece], s, e, BLOCK)[name])  # as saved at DP 2
    assert float(full["step"]) == 3.0


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_dp2_to_dp4_requantizes_the_cut_blocks_within_half_the_new_scale(bits):
    m, v = moments(10 + bits)
    saved = slices(m, v, DP2, bits)
    m_saved = torch.cat([dequantize(assemble([p], *p["range"], BLOCK)["exp_avg"]) for p in saved])
    v_saved = torch.cat([dequantize(assemble([p], *p["range"], BLOCK)["exp_avg_sq"])
                         for p in saved])
    worst_m = worst_v = 0.0
    for s, e in DP4:
        pieces = [p for p in saved if p["range"][0] < e and s < p["range"][1]]
        got = assemble(pieces, s, e, BLOCK)
        m_new, v_new = dequantize(got["exp_avg"]), dequantize(got["exp_avg_sq"])
        q = got["exp_avg"]
        half = (q.scales / 2).expand(-1, BLOCK).reshape(-1)[q.lead:q.lead + q.numel]
        err = (m_new - m_saved[s:e]).abs()
        assert (err <= half * (1 + 1e-6)).all()
        amax = m_saved.abs().max()
        worst_m = max(worst_m, float(err.max() / amax))
        assert torch.equal(v_new == 0, v_saved[s:e] == 0)  # zeros stay zeros, nothing new
        nonzero = v_saved[s:e] > 0
        rel = (v_new[nonzero] / v_saved[s:e][nonzero] - 1).abs()
        worst_v = max(worst_v, float(rel.max()))
    top = 2 ** (bits - 1) - 1
    assert 0 < worst_m <= 1 / (2 * top)  # the cut blocks moved, by less than a half step
    assert worst_v <= 1e-6  # v: whole rungs, float32 rounding only
    print(f"bits {bits}: max |dm| / max|m| {worst_m:.2e}, max |dv| / v {worst_v:.2e}")


def test_float32_state_and_main_copies_are_concatenated():
    g = torch.Generator().manual_seed(0)
    m, v, main = (torch.randn(NUMEL, generator=g) for _ in range(3))
    saved = [{"range": [s, e], "step": torch.tensor(2.0), "exp_avg": m[s:e],
              "exp_avg_sq": v[s:e].abs(), "main": main[s:e]} for s, e in DP2]
    for s, e in [(0, NUMEL), *DP4]:
        pieces = [p for p in saved if p["range"][0] < e and s < p["range"][1]]
        got = assemble(pieces, s, e, BLOCK)
        assert torch.equal(got["exp_avg"], m[s:e]) and torch.equal(got["main"], main[s:e])
        assert torch.equal(got["exp_avg_sq"], v[s:e].abs())


def test_a_slice_as_saved_is_taken_as_it_is():
    m, v = moments(3)
    piece = slices(m, v, [(512, NUMEL)], 4)[0]
    got = assemble([piece], 512, NUMEL, BLOCK)["exp_avg"]
    assert got.codes is piece["exp_avg"]["codes"]


def test_a_gap_in_the_saved_slices_is_refused():
    m, v = moments(4)
    with pytest.raises(UsageError, match=r"do not cover elements \[0, 1000\)"):
        assemble(slices(m, v, [(0, 512)], 8), 0, NUMEL, BLOCK)


@pytest.mark.parametrize("saved, message", [
    ({}, "holds no STQuant optimizer state"),
    ({"stquant": {"allocator": {}, "layout": {"tp": 1, "pp": 1, "dp": 2, "distributed": True}}},
     "earlier per-rank format"),
])
def test_checkpoints_it_cannot_read_are_refused_in_one_line(saved, message):
    with pytest.raises(UsageError, match=message) as info:
        saved_header(saved)
    assert "\n" not in str(info.value)
