"""QuantizedGemm against independent computations: each GEMM written out with fake_quant on
its operands along that GEMM's reduction axis, autograd of the dequantized forward where the
two must agree, and megatron's own GEMM function bit for bit in passthrough."""

import pytest
import torch
from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication

from megatron_ext.formats import fake_quant
from megatron_ext.precision import gemm
from megatron_ext.precision.gemm import quantized_gemm
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats, resolve

# ragged everywhere: T = 40*5 = 200 tokens, K = 200, N = 136 (none a multiple of 128)
S, B, K, N = 40, 5, 200, 136

FP8_MIXED = SiteFormats("fp8_e4m3@tile128", "fp8_e4m3@block128", "fp8_e5m2@tile128",
                        overrides=(("wgrad.x", "bf16"), ("dgrad.w", "fp8_e4m3@tile128")))
CASES = {
    "uniform-fp8": UNIFORM["fp8"],
    "uniform-fp4-nearest": SiteFormats("fp4_e2m1@tile128", "fp4_e2m1@block128",
                                       "fp4_e2m1@tile128"),
    "mx-nv": SiteFormats("mxfp8", "nvfp4", "mxfp4"),
    "per-gemm-overrides": FP8_MIXED,
    "fp4-per-tensor": UNIFORM["fp4-tensor"],  # q(x) and q(dy) serve two GEMMs each
    "square-blocks": SiteFormats("fp8_e4m3@block128", "fp4_e2m1", "fp4_e2m1@block128"),
}


def _tensors(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, K, generator=g, dtype=dtype)
    x[3, 1] *= 50  # an outlier token: tile scales along T and along K see it differently
    w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
    b = torch.randn(N, generator=g, dtype=dtype)
    dy = torch.randn(S, B, N, generator=g, dtype=dtype)
    return x, w, b, dy


def _run(x, w, b, dy, formats, real=False):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = quantized_gemm(x, w, b, resolve(formats), real=real)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def _close(got, ref, what=""):
    """float32 products against float64 ones: equal up to float32 accumulation error."""
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=2e-6 * ref.abs().max().item(),
                               msg=what)


def _fq(t, name, axis):
    return t if name == "none" else fake_quant(t, name, axis=axis)


def _reference(x, w, b, dy, f: SiteFormats):
    """The table of gemm.py, one fake_quant per operand, products in float64."""
    x2, dy2 = x.reshape(-1, K), dy.reshape(-1, N)
    y = _fq(x2, f.operand("fprop", "x"), 1).double() @ _fq(w, f.operand("fprop", "w"), 1).double().T
    dx = _fq(dy2, f.operand("dgrad", "dy"), 1).double() @ _fq(w, f.operand("dgrad", "w"), 0).double()
    dw = _fq(dy2, f.operand("wgrad", "dy"), 0).double().T @ _fq(x2, f.operand("wgrad", "x"), 0).double()
    return (y + b.double()).reshape(S, B, N), dx.reshape(S, B, K), dw, dy2.double().sum(0)


@pytest.mark.parametrize("name", list(CASES))
def test_each_gemm_quantizes_along_its_reduction_axis(name):
    x, w, b, dy = _tensors()
    got = _run(x, w, b, dy, CASES[name])
    for g, r, what in zip(got, _reference(x, w, b, dy, CASES[name]), ("y", "dx", "dw", "db")):
        _close(g, r, what)


def test_stochastic_dy_matches_the_reference_draw_for_draw():
    # fp4 dy with +sr: forward and backward seeded alike; the function quantizes dy for
    # dgrad, then dy and x for wgrad, the reference in the same order
    x, w, b, dy = _tensors(1)
    torch.manual_seed(7)
    got = _run(x, w, b, dy, UNIFORM["fp4"])
    torch.manual_seed(7)
    ref = _reference(x, w, b, dy, UNIFORM["fp4"])
    for g, r in zip(got, ref):
        _close(g, r)


@pytest.mark.parametrize("x_fmt,w_fmt", [("fp8_e4m3", "fp8_e4m3@block128"),
                                         ("fp4_e2m1", "fp4_e2m1@block128"), ("none", "mxfp8")])
def test_transposable_formats_equal_autograd_of_the_dequantized_forward(x_fmt, w_fmt):
    # per-tensor x and 128x128-block w look the same from both sides, so with dy unquantized
    # the three GEMMs are exactly what autograd derives from y = q(x) @ q(w).T (with
    # straight-through estimators); mxfp8 w (1x32 tiles) is not, and must differ
    x, w, b, dy = _tensors(2)
    got = _run(x, w, b, dy, SiteFormats(x_fmt, w_fmt, "none"))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    ste = lambda t, f, axis: t + (_fq(t.detach(), f, axis) - t.detach())
    y = ste(xs, x_fmt, -1) @ ste(ws, w_fmt, 1).T + b
    y.backward(dy)
    if w_fmt == "mxfp8":
        assert not torch.allclose(got[1], xs.grad, rtol=1e-4, atol=1e-4)
        return
    torch.testing.assert_close(got[0], y.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got[1], xs.grad, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(got[2], ws.grad, rtol=1e-6, atol=1e-4)


def test_tile_scaled_x_is_quantized_differently_for_wgrad():
    # the reason for the custom backward: tiles along K (fprop) != tiles along T (wgrad)
    x, _, _, _ = _tensors(3)
    x2 = x.reshape(-1, K)
    along_k = fake_quant(x2, "fp8_e4m3@tile128", axis=1)
    along_t = fake_quant(x2, "fp8_e4m3@tile128", axis=0)
    assert not torch.equal(along_k, along_t)
    w = torch.randn(300, 260)
    assert torch.equal(fake_quant(w, "fp4_e2m1@block128", axis=0),
                       fake_quant(w, "fp4_e2m1@block128", axis=1))


@pytest.mark.parametrize("formats,calls", [
    (UNIFORM["fp8"], 5),  # tiles: x along K and T, dy along N and T; the 128x128 w once
    (UNIFORM["fp4-tensor"], 3),  # one scale per tensor: each operand once
    (SiteFormats("fp4_e2m1", "fp4_e2m1", "fp4_e2m1+sr"), 4),  # dy's draws differ per GEMM
    (SiteFormats("fp4_e2m1", "fp4_e2m1", "fp4_e2m1", overrides=(("wgrad.x", "fp8_e4m3"),)), 4),
])
@pytest.mark.parametrize("real", [False, True])  # real: FP4 and tiles still run emulated
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton quantizers of CUDA"))])
def test_an_operand_is_quantized_once_when_both_gemms_see_it_alike(formats, calls, real,
                                                                  device, monkeypatch):
    seen = []
    real_fake_quant = gemm.fake_quant
    monkeypatch.setattr(gemm, "fake_quant", lambda t, fmt, **kw: (
        seen.append(str(fmt)), real_fake_quant(t, fmt, **kw))[1])
    x, w, b, dy = (t.to(device) for t in _tensors(8))
    torch.manual_seed(3)
    got = _run(x, w, b, dy, formats, real)
    assert len(seen) == calls, seen
    torch.manual_seed(3)  # the reference draws dgrad's dy first, then wgrad's, as the GEMM
    for g, r, what in zip(got, _reference(x, w, b, dy, formats), ("y", "dx", "dw", "db")):
        _close(g, r, what)


def test_an_input_its_producer_keeps_is_kept_itself_and_quantized_again(monkeypatch):
    # proj's x (fused attention keeps it): keeping q(x) too would hold two copies
    seen = []
    real_fake_quant = gemm.fake_quant
    monkeypatch.setattr(gemm, "fake_quant", lambda t, fmt, **kw: (
        seen.append(tuple(t.shape)), real_fake_quant(t, fmt, **kw))[1])
    x, w, b, dy = _tensors(9)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quantized_gemm(xs, ws, b, resolve(UNIFORM["fp4-tensor"]), own_x=False)
    y.backward(dy)
    assert seen == [(N, K), (S, B, K), (S * B, N), (K, S * B)]  # w, x, dy; x again along T
    ref = _reference(x, w, b, dy, UNIFORM["fp4-tensor"])
    for g, r in zip((y.detach(), xs.grad, ws.grad), ref):
        _close(g, r)
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron_ext.precision.layers import quantized_class
    assert not quantized_class(RowParallelLinear, 0, "proj").own_input
    assert quantized_class(RowParallelLinear, 0, "fc2").own_input


def test_block_weight_is_quantized_once_for_fprop_and_dgrad():
    assert resolve(UNIFORM["fp8"]).dgrad_reuses_fprop_w
    assert resolve(UNIFORM["fp4"]).dgrad_reuses_fprop_w
    assert not resolve(FP8_MIXED).dgrad_reuses_fprop_w  # dgrad.w overridden to tiles
    assert not resolve(SiteFormats("none", "mxfp8", "none")).dgrad_reuses_fprop_w
    assert not resolve(SiteFormats("none", "fp4_e2m1@block128+sr", "none")).dgrad_reuses_fprop_w
    per_tensor = resolve(UNIFORM["fp4-tensor"])
    assert per_tensor.wgrad_reuses_fprop_x and per_tensor.wgrad_reuses_dgrad_dy
    tiles = resolve(UNIFORM["fp8"])
    assert not tiles.wgrad_reuses_fprop_x and not tiles.wgrad_reuses_dgrad_dy


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "none"), (torch.float32, "fp32"),
                                       (torch.bfloat16, "none"), (torch.bfloat16, "fp32"),
                                       (torch.bfloat16, "bf16")])
def test_passthrough_is_bitwise_megatrons_gemm(fmt, dtype):
    # "none", and casts that cannot change the values, run megatron's very products
    x, w, b, dy = _tensors(4, dtype)
    got = _run(x, w, b, dy, SiteFormats(fmt, fmt, fmt))
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    y = LinearWithGradAccumulationAndAsyncCommunication.apply(
        xs, ws, bs, False, False, False, None, None, None)
    y.backward(dy)
    for g, r in zip(got, (y.detach(), xs.grad, ws.grad, bs.grad)):
        assert g.dtype == dtype and torch.equal(g, r)


def test_frozen_weight_and_no_bias():
    x, w, _, dy = _tensors(5)
    xs = x.clone().requires_grad_()
    y = quantized_gemm(xs, w, None, resolve(UNIFORM["fp8"]))
    y.backward(dy)
    ref = _reference(x, w, torch.zeros(N), dy, UNIFORM["fp8"])
    _close(xs.grad, ref[1])


def test_bf16_operands_give_bf16_outputs():
    x, w, b, dy = _tensors(6, torch.bfloat16)
    got = _run(x, w, b, dy, UNIFORM["fp8"])
    assert {t.dtype for t in got} == {torch.bfloat16}
    for g, r in zip(got, _reference(x, w, b, dy, UNIFORM["fp8"])):  # BF16 output rounding
        torch.testing.assert_close(g.double(), r, rtol=1e-2, atol=1e-2 * r.abs().max().item())


def test_wgrad_x_per_token_touches_only_the_weight_gradient():
    """``uniform:wgrad-x4-token`` (GNMR §5.1): y and dx exact, dw = dy.T @ q(x) in float64
    with q = E2M1 with its own scale per token (each row of x quantized on its own)."""
    x, w, b, dy = _tensors()
    y, gx, gw, _ = _run(x, w, b, dy, UNIFORM["wgrad-x4-token"])
    ref_y, ref_gx, _, _ = _run(x, w, b, dy, SiteFormats())
    assert torch.equal(y, ref_y) and torch.equal(gx, ref_gx)
    x2 = x.reshape(-1, K)
    qx = torch.stack([fake_quant(row, "fp4_e2m1") for row in x2]).double()
    expected = dy.reshape(-1, N).double().t() @ qx
    _close(gw, expected, "wgrad")
