"""Real FP8 GEMMs (``--fp8-execution``): each of a site's three GEMMs on FP8 data through
``torch._scaled_mm`` against the emulated GEMM (CPU runs per-tensor and per-row scales for
real), the blockwise scale layouts against a reference of Hopper's documented semantics,
and which GEMMs fall back to emulation."""

import pytest
import torch

from megatron_ext.formats import get_format
from megatron_ext.formats.fp8 import to_fp8
from megatron_ext.precision import real_gemm
from megatron_ext.precision.gemm import quantized_gemm
from megatron_ext.precision.site_formats import SiteFormats, resolve

S, B, K, N = 8, 4, 64, 48  # T = 32 tokens; every dimension a multiple of 16

CASES = {
    "tensor": SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e4m3"),
    "row": SiteFormats("fp8_e4m3@row", "fp8_e4m3@row", "fp8_e4m3@row"),
    "row-hybrid": SiteFormats("fp8_e4m3@row", "fp8_e4m3@row", "fp8_e5m2@row"),
}


def _tensors(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, K, generator=g)
    x[3, 1] *= 50  # an outlier token
    w = torch.randn(N, K, generator=g) * 0.05
    return (x.to(dtype), w.to(dtype), torch.randn(N, generator=g).to(dtype),
            torch.randn(S, B, N, generator=g).to(dtype))


def _run(formats, real, dtype):
    x, w, b, dy = _tensors(dtype)
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = quantized_gemm(x, w, b, resolve(formats), real=real)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.fixture
def count_scaled_mm(monkeypatch):
    calls = []
    original = torch._scaled_mm

    def counted(*args, **kwargs):
        if args[0].shape != (512, 512):  # not real_gemm.supported's one-time trial
            calls.append(args[0].dtype)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counted)
    return calls


@pytest.mark.parametrize("case", CASES)
def test_real_fp8_gemms_equal_emulated_up_to_fp32_accumulation(case, count_scaled_mm):
    emulated = _run(CASES[case], False, torch.float32)
    assert not count_scaled_mm
    real = _run(CASES[case], True, torch.float32)
    assert len(count_scaled_mm) == 3  # fprop, dgrad, wgrad all ran on FP8 data
    for what, got, ref in zip(("y", "dx", "dw", "db"), real, emulated):
        # emulated rounds each q * d to float32 (2**-24), and the summation orders differ
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(),
                                   msg=what)


def test_in_bf16_real_is_closer_to_the_exact_product_than_emulated():
    """BF16 emulation rounds each ``q * d`` to BF16 before the GEMM; the real GEMM applies the
    scales in its FP32 accumulator: both near the float64 product of the FP8 values."""
    formats = CASES["tensor"]
    x, w, _, _ = _tensors(torch.bfloat16)
    x2 = x.reshape(-1, K)
    qx, qw = (to_fp8(t, get_format("fp8_e4m3")) for t in (x2, w))
    exact = (qx.data.double() * qx.scale.double()) @ (qw.data.double() * qw.scale.double()).t()
    real = real_gemm.fp8_gemm(x2, get_format("fp8_e4m3"), w, get_format("fp8_e4m3"))
    emulated = quantized_gemm(x, w, None, resolve(formats)).reshape(-1, N)
    err_real = (real.double() - exact).abs().max() / exact.abs().max()
    err_emulated = (emulated.double() - exact).abs().max() / exact.abs().max()
    assert err_real < 1e-2 and err_emulated < 2e-2
    assert err_real <= err_emulated


def _hopper_blockwise_reference(a, b, scale_a, scale_b, out_dtype):
    """``_scaled_mm`` with 1x128 x 128x128 (or 1x128) scales as torch documents them for
    Hopper: scale_a ``(M, R/128)`` and scale_b ``(R/128, N/128)`` (or ``(R/128, N)``), both
    stored with the reduction-block index outermost."""
    m, r = a.shape
    n = b.shape[1]
    assert b.stride(0) == 1, "b must be column-major"
    assert scale_a.shape == (m, r // 128) and scale_a.stride() == (1, m)
    assert scale_b.shape in ((r // 128, n // 128), (r // 128, n))
    out = torch.zeros(m, n, dtype=torch.float64)
    for kb in range(r // 128):
        cols = slice(128 * kb, 128 * (kb + 1))
        sb = scale_b[kb].double()
        sb = sb.repeat_interleave(128) if sb.numel() == n // 128 else sb
        out += ((a[:, cols].double() * scale_a[:, kb:kb + 1].double()) @
                (b[cols, :].double() * sb[None, :]))
    return out.to(out_dtype)


@pytest.mark.parametrize("fmt_b", ["fp8_e4m3@block128", "fp8_e4m3@tile128"])
def test_blockwise_scale_layouts_are_hoppers(monkeypatch, fmt_b):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(256, 384, generator=g) * 2.0 ** torch.randint(-6, 6, (256, 1), generator=g)
    b = torch.randn(128, 384, generator=g) * 2.0 ** torch.randint(-6, 6, (1, 384), generator=g)
    qa, qb = to_fp8(a, get_format("fp8_e4m3@tile128")), to_fp8(b, get_format(fmt_b))
    monkeypatch.setattr(torch, "_scaled_mm", _hopper_blockwise_reference)
    got = real_gemm.scaled_mm(qa, qb, torch.float64, layout=0)  # the documented layout
    ref = real_gemm._dequantized(qa) @ real_gemm._dequantized(qb).t()
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


def test_what_runs_real_on_this_cpu():
    t, r = torch.ones(32, 64), torch.ones(48, 64)
    f = get_format
    assert real_gemm.runs_real(f("fp8_e4m3"), f("fp8_e5m2"), t, r)
    assert real_gemm.runs_real(f("fp8_e4m3@row"), f("fp8_e4m3@row"), t, r)
    assert not real_gemm.runs_real(f("fp8_e4m3@row"), f("fp8_e4m3"), t, r)  # mixed scalings
    assert not real_gemm.runs_real(f("fp8_e4m3"), f("fp4_e2m1"), t, r)
    assert not real_gemm.runs_real(f("fp8_e4m3"), None, t, r)
    assert not real_gemm.runs_real(f("fp8_e4m3"), f("fp8_e4m3"), torch.ones(30, 64), r)
    # blockwise: the reduction must hold a multiple of 4 scale blocks (see real_gemm)
    assert not real_gemm.runs_real(f("fp8_e4m3@tile128"), f("fp8_e4m3@tile128"),
                                   torch.ones(128, 256), torch.ones(128, 256))
    # torch runs no blockwise _scaled_mm on CPU: the trial says so, the GEMM stays emulated
    tiles, blocks = torch.ones(128, 512), torch.ones(128, 512)
    assert not real_gemm.runs_real(f("fp8_e4m3@tile128"), f("fp8_e4m3@block128"), tiles, blocks)


def test_uniform_fp8_falls_back_to_emulation_where_cpu_cannot_run_it(count_scaled_mm):
    """DeepSeek's tiles x blocks has no CPU kernel: real mode must give emulated results."""
    from megatron_ext.precision.policies import UNIFORM

    x, w, b, dy = _tensors(torch.float32)
    x = torch.randn(8, 16, 128)
    w = torch.randn(128, 128) * 0.05
    outs = []
    for real in (False, True):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = quantized_gemm(xr, wr, None, resolve(UNIFORM["fp8"]), real=real)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), xr.grad, wr.grad))
    assert not count_scaled_mm
    for got, ref in zip(*outs):
        assert torch.equal(got, ref)


def test_execution_modes():
    cpu = torch.device("cpu")
    assert real_gemm.wants_real("real", cpu) and not real_gemm.wants_real("auto", cpu)
    assert not real_gemm.wants_real("emulated", cpu)
    with pytest.raises(ValueError, match="--fp8-execution"):
        real_gemm.wants_real("fast", cpu)
    assert "emulated" in real_gemm.describe("auto", cpu)
    assert ("real (torch._scaled_mm) on CPU for tensorxtensor, rowxrow;" in
            real_gemm.describe("real", cpu))


@pytest.mark.parametrize("case,fp8_kept", [("tensor", True), ("row", False)])
def test_an_axis_free_x_is_kept_for_wgrad_in_fp8(case, fp8_kept):
    """Per tensor, q(x) along K is q(x) along T: the forward keeps it in FP8 instead of x."""
    x, w, b, _ = _tensors(torch.float32)
    x.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        quantized_gemm(x, w.requires_grad_(), b, resolve(CASES[case]), real=True)
    fp8 = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    assert bool(fp8) == fp8_kept
    assert any(t is x for t in saved) != fp8_kept
    if fp8_kept:  # kept transposed: wgrad's operand, written by fprop's cast
        assert fp8[0].shape == (K, S * B)
