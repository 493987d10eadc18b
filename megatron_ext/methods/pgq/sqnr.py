"""SQNR, the signal-to-quantization-noise ratio of one GEMM operand (PGQ eq. 1), and the
candidate formats PGQ measures it for.

    SQNR(X) = ‖X‖² / ‖Q(X) − X‖²   ( = E[X²] / E[(Q(X) − X)²] ),   in dB: 10·log10 SQNR

``Q`` is the quantizer the GEMM itself would apply: blocks along **that GEMM's reduction
axis**, exactly as :mod:`megatron_ext.precision.gemm` does it (``x`` along K for fprop and
along the tokens T for wgrad, ``dy`` along N for dgrad and along T for wgrad, ``w`` along K
for fprop and along N for dgrad). :func:`oriented` turns an operand into the 2-D tensor whose
last dimension is that axis, and :func:`noise_sums` quantizes it with ``gemm.quantize`` — the
very function the quantized GEMM calls. A profile adds numerators and denominators over
micro-batches, steps and ranks and divides once at the end: the SQNR of every token seen,
not a mean of per-batch ratios.

**Reference values** (``tests/unit/methods/pgq/test_pgq_sqnr.py`` checks them):

* a symmetric b-bit integer quantizer (``q_max = 2^(b-1) − 1`` steps each side of zero,
  step ``Δ = a / q_max``) fed ``X`` uniform on ``[−a, a]``, so the input fills its range:
  round-to-nearest noise is uniform on ``±Δ/2``, variance ``Δ²/12``, the signal's ``a²/3``,
  so ``SQNR = 4·q_max² = (2^b − 2)²``: ``20·log10(2^b − 2)`` dB ≈ 6.02·b dB (int8: 48.10 dB,
  against 6.02·8 = 48.16);
* stochastic rounding from a point a fraction ``p`` of a step above the grid point below
  has error variance ``p(1 − p)·Δ²``, ``Δ²/6`` averaged over ``p``: twice round-to-nearest's,
  SQNR 3.01 dB lower;
* **scale invariance**: an amax-scaled format maps each block's largest magnitude onto the
  grid's largest value, so ``Q(c·X) = c·Q(X)`` exactly for every power of two ``c`` and up to
  the scale's cleared last bits for any ``c``: the SQNR of a tensor does not depend on its
  magnitude, which is what lets PGQ rank the operands of a whole network on one scale. MX's
  power-of-two scales are invariant only under powers of two; an unscaled format
  (``fp8_e4m3@none``) is not invariant at all (underflow and saturation depend on magnitude).

**Candidates** (:data:`CANDIDATES`): the paper's int8 with one scale per non-contracting
index (``int8@row`` along the reduction axis) and stochastic rounding for the gradient, and
the project's FP8 / MX / NVFP4 / FP4 recipes. A candidate gives each role (``x``, ``w``,
``dy``) one format, used in both GEMMs that read the role.
"""

from __future__ import annotations

import math

import torch

from megatron_ext.formats import error_sums, get_format
from megatron_ext.precision.gemm import quantize
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats

CANDIDATES = {
    "int8": SiteFormats("int8@row", "int8@row", "int8@row+sr"),
    "fp8": UNIFORM["fp8"],
    "mxfp8": SiteFormats("mxfp8", "mxfp8", "mxfp8"),
    "nvfp4": SiteFormats("nvfp4", "nvfp4", "nvfp4+sr"),
    "mxfp4": SiteFormats("mxfp4", "mxfp4", "mxfp4+sr"),
    "fp4": UNIFORM["fp4"],
    "fp4-tensor": UNIFORM["fp4-tensor"],
    "fp4-tensor-sr": SiteFormats("fp4_e2m1", "fp4_e2m1", "fp4_e2m1+sr"),
}
"""Candidate name -> role formats: int8 per channel with SR on ``dy`` (the paper's),
DeepSeek-V3's FP8 (``uniform:fp8``), MXFP8, NVFP4 and MXFP4 (SR on ``dy``), the
project's FP4 (``uniform:fp4``) and the comparison regime's per-tensor FP4
(``uniform:fp4-tensor``), also with SR on ``dy`` (``fp4-tensor-sr``: the paper rounds
gradients stochastically)."""

TRANSPOSED = frozenset({("dgrad", "w"), ("wgrad", "dy"), ("wgrad", "x")})
"""Linear-site operands whose reduction axis is the *first* dimension of the tensor as the
layer holds it (``w`` is ``N x K``, ``x`` and ``dy`` are tokens first)."""


def sqnr(signal: float, noise: float) -> float:
    """``signal / noise``; ``inf`` when quantization was exact (zero noise)."""
    return math.inf if noise == 0 else signal / noise


def to_db(ratio: float) -> float:
    """``10·log10(ratio)`` (``inf`` stays ``inf``, 0 is ``-inf``)."""
    return math.inf if ratio == math.inf else (10 * math.log10(ratio) if ratio > 0 else -math.inf)


def oriented(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``t`` as a 2-D tensor (leading dims flattened into rows) whose last dimension is the
    GEMM's reduction axis: transposed when that axis is the rows (``w`` along N, tokens)."""
    flat = t.detach().reshape(-1, t.shape[-1])
    return flat.t() if transposed else flat


def noise_sums(t2: torch.Tensor, formats: dict[str, str], group=None) -> torch.Tensor:
    """``[‖t‖², ‖Q_c(t) − t‖² for each candidate c of formats]``, float64 on ``t2``'s device
    (no host synchronisation), for ``t2`` from :func:`oriented`, each candidate's format
    applied along the last dimension as ``gemm.quantize`` does (a tensor-wide scale from the
    whole tensor over the TP ``group``). The sums are :func:`~megatron_ext.formats.error_sums`
    (one Triton pass over ``t`` and ``Q_c(t)`` on a GPU)."""
    t2 = t2.contiguous()  # one copy of a transposed operand, not one per candidate
    errors = [error_sums(t2, quantize(t2, get_format(fmt), axis=-1, group=group), False)
              for fmt in formats.values()]
    signal = errors[0][2] if errors else error_sums(t2, t2, False)[2]
    return torch.stack([signal, *(e[1] for e in errors)])
