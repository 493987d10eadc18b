"""SQNR (PGQ eq. 1) against analytic values, its scale invariance, and each operand quantized
exactly as the quantized GEMM quantizes it."""

import math

import pytest
import torch

from megatron_ext.methods.pgq.sqnr import (CANDIDATES, TRANSPOSED, noise_sums, oriented, sqnr,
                                           to_db)
from megatron_ext.precision.gemm import quantized_gemm
from megatron_ext.precision.site_formats import PASSTHROUGH, SiteFormats, resolve
from megatron_ext.sites import OPERANDS


def _db(t: torch.Tensor, fmt: str, transposed: bool = False) -> float:
    signal, noise = noise_sums(oriented(t, transposed), {"f": fmt}).tolist()
    return to_db(sqnr(signal, noise))


def _filling_uniform(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Uniform on [-1, 1] with every row's amax exactly 1: the input fills a per-row
    quantizer's range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, cols, generator=g, dtype=torch.float64) * 2 - 1
    x[:, 0], x[:, 1] = 1.0, -1.0
    return x.float()


@pytest.mark.parametrize("bits", [8, 4])
def test_uniform_input_filling_a_b_bit_quantizer(bits):
    x = _filling_uniform(512, 2048)  # 1M samples: the estimate's std is ~0.004 dB
    expected = 20 * math.log10(2 ** bits - 2)  # 4·q_max², q_max = 2^(b-1) - 1
    assert _db(x, f"int{bits}@row") == pytest.approx(expected, abs=0.03)
    # stochastic rounding: error variance Δ²/6 instead of Δ²/12, 3.01 dB lower
    assert _db(x, f"int{bits}@row+sr") == pytest.approx(expected - 10 * math.log10(2), abs=0.03)
    if bits == 8:  # the rule of thumb
        assert _db(x, "int8@row") == pytest.approx(6.02 * 8, abs=0.1)


DETERMINISTIC = sorted({getattr(f, role) for f in CANDIDATES.values() for role in ("x", "w")})


@pytest.mark.parametrize("fmt", DETERMINISTIC)
def test_scaled_formats_are_scale_invariant(fmt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 512, generator=g)
    x[3, 7] = 40.0  # an outlier
    base = _db(x, fmt)
    for power in (-20, -3, 9):  # powers of two: every scale (amax, E8M0, NVFP4's) is exact
        assert _db(x * 2.0 ** power, fmt) == base
    if not fmt.startswith("mx"):  # amax scales follow any factor, up to their cleared bits
        assert _db(x * 3.7, fmt) == pytest.approx(base, abs=0.05)


def test_an_unscaled_format_is_not_scale_invariant():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(2))
    assert _db(x, "fp8_e4m3@none") > 25
    assert _db(x * 2.0 ** -12, "fp8_e4m3@none") < 10  # most values underflow


def test_exact_quantization_is_infinite():
    x = torch.tensor([[1.0, -0.5, 0.0, 0.25]])
    signal, noise = noise_sums(oriented(x, False), {"q": "mxfp8"}).tolist()  # power-of-2 scale
    assert noise == 0 and sqnr(signal, noise) == math.inf == to_db(math.inf)


T_S, T_B, K, N = 96, 2, 256, 384  # 192 tokens: tiles along T end ragged


def _quantized_like(t: torch.Tensor, gemm: str, role: str, fmt: str) -> torch.Tensor:
    """``t`` (2-D) with the profile's quantizer applied, back in ``t``'s orientation."""
    from megatron_ext.formats import get_format
    from megatron_ext.precision.gemm import quantize

    transposed = (gemm, role) in TRANSPOSED
    q = quantize(oriented(t, transposed), get_format(fmt), axis=-1)
    return q.t() if transposed else q


@pytest.mark.parametrize("operand", OPERANDS)
@pytest.mark.parametrize("fmt", ["fp8_e4m3@tile128", "int8@row", "mxfp4"])
def test_operands_are_quantized_as_the_quantized_gemm_does(operand, fmt):
    """Only ``operand`` quantized: the GEMM that reads it must equal the product with the
    profile's quantized operand (the axis matters: tiles / rows / MX blocks along another
    axis give other values)."""
    gemm, role = operand.split(".")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T_S, T_B, K, generator=g).requires_grad_()
    w = (torch.randn(N, K, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(T_S, T_B, N, generator=g)
    dy[5, 1] *= 30
    ops = resolve(SiteFormats(PASSTHROUGH, PASSTHROUGH, PASSTHROUGH, overrides=((operand, fmt),)))
    y = quantized_gemm(x, w, None, ops)
    y.backward(dy)
    x2, dy2, wd = x.detach().reshape(-1, K), dy.reshape(-1, N), w.detach()
    tensors = {"x": x2, "w": wd, "dy": dy2}
    tensors[role] = _quantized_like(tensors[role], gemm, role, fmt)
    expected = {"fprop": (y.reshape(-1, N), tensors["x"] @ tensors["w"].t()),
                "dgrad": (x.grad.reshape(-1, K), tensors["dy"] @ tensors["w"]),
                "wgrad": (w.grad, tensors["dy"].t() @ tensors["x"])}[gemm]
    torch.testing.assert_close(*expected, rtol=1e-5, atol=1e-5)
