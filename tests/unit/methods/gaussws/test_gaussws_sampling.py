"""Eq. 1-3 and 6: ŵ against the explicit formula, eq. 3 against autograd of that formula
(float64), R regenerated bit for bit in the backward pass, TP shards equal to TP=1."""

import math

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.methods.gaussws import noise, sampling
from megatron_ext.methods.gaussws.layout import ShardLayout, combine_block_amax, local_block_amax
from megatron_ext.methods.gaussws.sampling import GaussSample, sample_weight

KEY = 987654321


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _explicit(w, bits, key, block=32):
    """Eq. 1 written out on the full weight: brute-force tile maxima (no gradient, eq. 2's
    approximation), R from the generator, broadcast by repeat_interleave."""
    m, n = w.shape
    amax = torch.zeros(bits.shape, dtype=w.dtype)
    for i in range(bits.shape[0]):
        for j in range(bits.shape[1]):
            tile = w.detach()[i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax[i, j] = tile.abs().max()
    s = amax * torch.exp2(1 - bits)
    s_full = s.repeat_interleave(block, 0)[:m].repeat_interleave(block, 1)[:, :n]
    r = noise.noise_block(torch.arange(m), 0, n, n, key, w.dtype)
    return w + r * s_full


def _raw(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _bits(shape, block=32, seed=1, dtype=torch.float64):
    grid = (-(-shape[0] // block), -(-shape[1] // block))
    return 3 + 5 * torch.rand(grid, generator=_gen(seed), dtype=dtype)


@pytest.mark.parametrize("shape", [(128, 352), (70, 100), (33, 31)])
def test_forward_equals_the_explicit_formula(shape):
    w = torch.randn(shape, generator=_gen(), dtype=torch.float64)
    bits = _bits(shape)
    assert torch.equal(sample_weight(w, bits, KEY), _explicit(w, bits, KEY))


def test_eq3_gradient_equals_autograd_of_the_explicit_formula():
    w = torch.randn(70, 100, generator=_gen(), dtype=torch.float64, requires_grad=True)
    bits = _bits((70, 100)).requires_grad_()
    g = torch.randn(70, 100, generator=_gen(2), dtype=torch.float64)
    (sample_weight(w, bits, KEY) * g).sum().backward()
    got_w, got_b = w.grad.clone(), bits.grad.clone()
    w.grad = bits.grad = None
    (_explicit(w, bits, KEY) * g).sum().backward()
    assert torch.equal(got_w, w.grad)  # eq. 2: dL/dw = dL/dŵ
    assert (got_b - bits.grad).abs().max() <= 1e-12 * bits.grad.abs().max()


def test_gradients_match_central_differences_with_tile_maxima_held_constant():
    w = torch.randn(9, 10, generator=_gen(), dtype=torch.float64, requires_grad=True)
    layout = ShardLayout.full(9, 10, block=4)
    bits = _bits((9, 10), block=4).requires_grad_()
    amax = local_block_amax(w, layout)
    g = torch.randn(9, 10, generator=_gen(2), dtype=torch.float64)

    def loss(w_, b_):
        return (GaussSample.apply(w_, b_, amax, KEY, layout, None) * g).sum()

    loss(w, bits).backward()
    h = 1e-6
    for x, grad in ((bits, bits.grad), (w, w.grad)):
        for k in range(0, x.numel(), 4):
            e = torch.zeros(x.numel(), dtype=x.dtype)
            e[k] = h
            e = e.view(x.shape)
            with torch.no_grad():
                pairs = ((w + e, bits), (w - e, bits)) if x is w else ((w, bits + e), (w, bits - e))
                fd = (loss(*pairs[0]) - loss(*pairs[1])) / (2 * h)
            assert abs(fd - grad.view(-1)[k]) <= 1e-6 * (1 + abs(fd)), (k, fd, grad.view(-1)[k])


def test_backward_regenerates_the_forward_noise_bit_for_bit(monkeypatch):
    """ŵ - w is exact here (w on a 2^-8 grid, each tile's max 1, integer b_t), so the
    forward's R can be read back from ŵ; the bit-width gradient must use that same R."""
    w = torch.randint(-255, 256, (64, 96), generator=_gen()).float() / 256
    w[::32, ::32] = 1.0
    bits = torch.randint(3, 8, (2, 3), generator=_gen(1)).float().requires_grad_()
    calls = []
    real = noise.noise_block
    monkeypatch.setattr(noise, "noise_block", lambda *a: calls.append(a) or real(*a))
    w_hat = sample_weight(w, bits, KEY)
    s = torch.exp2(1 - bits.detach())
    s_full = s.repeat_interleave(32, 0).repeat_interleave(32, 1)
    r_fwd = (w_hat - w) / s_full
    assert torch.equal(r_fwd, r_fwd.round()) and r_fwd.abs().max() == 2
    g = torch.randint(-3, 4, (64, 96), generator=_gen(2)).float()
    w_hat.backward(g)
    assert len(calls) == 2  # generated in forward, regenerated (not stored) in backward
    dot = (g * r_fwd).reshape(2, 32, 3, 32).sum((1, 3))
    assert torch.equal(bits.grad, -math.log(2.0) * s * dot)


def test_only_the_scale_grid_is_saved_for_backward():
    w = torch.randn(128, 352, requires_grad=True)
    bits = torch.full((4, 11), 6.0, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sample_weight(w, bits, KEY)
    assert sum(t.numel() for t in saved) == bits.numel()


SHARDS = [((128, 352), 2, 1, 1), ((704, 128), 2, 0, 2), ((100, 70), 2, 1, 1), ((100, 70), 2, 0, 1),
          ((120, 50), 4, 0, 2)]  # fmt: skip


@pytest.mark.parametrize("shape,tp,dim,parts", SHARDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tp_shards_equal_tp1(shape, tp, dim, parts, dtype):
    full = torch.randn(shape, generator=_gen()).to(dtype).requires_grad_()
    bits = _bits(shape, dtype=torch.float32).requires_grad_()
    g = torch.randn(shape, generator=_gen(3)).to(dtype)
    w_hat = sample_weight(full, bits, KEY)
    w_hat.backward(g)
    layouts = [ShardLayout.tensor_parallel(shape, tp, r, dim, parts) for r in range(tp)]
    c = [lay.col_range for lay in layouts]
    rows = [lay.global_rows() for lay in layouts]
    shards = [full.detach()[r][:, c0:c1].clone().requires_grad_() for r, (c0, c1) in zip(rows, c)]
    amax = combine_block_amax([local_block_amax(s, lay) for s, lay in zip(shards, layouts)])
    bits_grad = torch.zeros_like(bits)
    for shard, lay, r, (c0, c1) in zip(shards, layouts, rows, c):
        b = bits.detach().clone().requires_grad_()
        out = GaussSample.apply(shard, b, amax, KEY, lay, None)
        assert torch.equal(_raw(out), _raw(w_hat.detach()[r][:, c0:c1]))  # bit for bit
        out.backward(g[r][:, c0:c1])
        assert torch.equal(shard.grad, g[r][:, c0:c1])
        bits_grad += b.grad  # what the all-reduce SUM over the TP group adds up
    assert (bits_grad - bits.grad).abs().max() <= 1e-5 * bits.grad.abs().max()


def test_pqn_has_mean_zero():
    w = torch.randn(512, 512, generator=_gen())
    bits = torch.full((16, 16), 4.0)
    pqn = (sample_weight(w, bits, KEY) - w).double()
    s = local_block_amax(w, ShardLayout.full(512, 512)).double() * 2**-3
    sd = math.sqrt(75 / 256 * (s**2).mean().item() / w.numel())
    assert abs(pqn.mean().item()) <= 3 * sd


def test_underflow_bound_matches_the_paper_examples():
    assert sampling.underflow_bound(sampling.format_mantissa_bits("bf16")) == 9
    assert sampling.underflow_bound(7, r=4) == 5  # U(-0.5, 0.5) in 4 bits, BF16
    bounds = {n: sampling.underflow_bound(sampling.format_mantissa_bits(n))
              for n in ("fp8_e4m3", "fp8_e5m2", "mxfp4", "fp16")}
    assert bounds == {"fp8_e4m3": 5, "fp8_e5m2": 4, "mxfp4": 3, "fp16": 12}
    with pytest.raises(UsageError):
        sampling.format_mantissa_bits("int8@row")


def test_noise_survives_the_bf16_cast_up_to_the_bound():
    """Eq. 4 at eq. 6's bound: at b_t = 9 every nonzero R changes the BF16 value of ŵ; at
    b_t = 10 a |R| = 1 noise on an element inside its tile's top binade is rounded away."""
    w = torch.randn(256, 256, generator=_gen()).bfloat16().float()
    r = noise.noise_block(torch.arange(256), 0, 256, 256, KEY)
    amax = local_block_amax(w, ShardLayout.full(256, 256))
    amax_full = amax.repeat_interleave(32, 0).repeat_interleave(32, 1)
    mant, exp = torch.frexp(w.abs())
    top = (exp == torch.frexp(amax_full).exponent) & (mant != 0.5)  # 2^e: lower binade's grid
    changed = {}
    for b in (9, 10):
        w_hat = sample_weight(w, torch.full((8, 8), float(b)), KEY).bfloat16().float()
        changed[b] = w_hat != w
    assert changed[9][r != 0].all()
    assert not changed[10][(r.abs() == 1) & top].any() and changed[10][r != 0].any()


def test_row_chunking_changes_nothing(monkeypatch):
    layout = ShardLayout((200, 90), ((10, 50), (110, 150)), (7, 61), block=16)
    w = torch.randn(layout.shape, generator=_gen())
    scale = sampling.block_scale(local_block_amax(w, layout), torch.full(layout.grid_shape, 4.0))
    whole = (sampling.perturb(w, scale, layout, KEY), sampling.noise_dot(w, layout, KEY))
    monkeypatch.setattr(sampling, "CHUNK_ELEMS", 100)  # two rows per chunk
    chunked = (sampling.perturb(w, scale, layout, KEY), sampling.noise_dot(w, layout, KEY))
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels take CUDA tensors")
def test_the_cuda_kernels_give_the_torch_paths_values():
    """On a GPU: ŵ bit for bit, eq. 3's sums to float32 rounding of the float64 ones (the
    interpreter cases check the same kernels' logic on CPU; this checks their compile)."""
    layout = ShardLayout.tensor_parallel((128, 352), 2, 1, dim=1)  # a shard cutting a tile
    w = torch.randn(layout.shape, generator=_gen()).bfloat16()
    bits = 2 + 6 * torch.rand(layout.grid_shape, generator=_gen(1))
    scale = sampling.block_scale(local_block_amax(w, layout), bits)
    expected = sampling.perturb(w, scale, layout, KEY)
    got = sampling.perturb(w.cuda(), scale.cuda(), layout, KEY)
    assert got.is_cuda and torch.equal(got.cpu().view(torch.int16), expected.view(torch.int16))
    grad = torch.randn(layout.shape, generator=_gen(2)).bfloat16()
    reference = sampling.noise_dot(grad.double(), layout, KEY)
    dot = sampling.noise_dot(grad.cuda(), layout, KEY)
    assert dot.is_cuda and dot.dtype == torch.float32 and reference.abs().max() > 1
    torch.testing.assert_close(dot.cpu().double(), reference, rtol=1e-5, atol=1e-3)
