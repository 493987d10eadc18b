"""Rounding a tensor onto a grid whose spacing is a power of two, in place.

Every element type in this package is a grid of representable values; near any value
``v`` the grid is evenly spaced with a power-of-two step ``u`` (the "ulp" of the element
type at ``v``). Rounding is therefore always "round ``v`` to a multiple of ``u``", done on a
float32 (or float64) work tensor with no casts and no float64 temporaries:

* **nearest-even**: the magic-number trick. With ``C = 1.5 * 2**23 * u`` (float32),
  ``C`` and ``v + C`` share a binade whose ulp is exactly ``u``, so the hardware addition
  ``v + C`` rounds ``v`` to a multiple of ``u`` with ties to even, and ``(v + C) - C``
  is exact. Two in-place adds, vectorised by torch.
* **stochastic**: ``u * floor(v / u + r)`` with ``r`` uniform in ``[0, 1)``, so ``v`` rounds
  up with probability ``frac(v / u)`` and the expected value is ``v`` (unbiased). ``v / u``
  is exact (power of two) and ``r`` is drawn on a grid of ``2**(int_bits - 24)`` so that
  ``v / u + r`` is exact too whenever ``v`` lies in the normal range of the element type;
  a value already on the grid never moves. Reproducible through a ``torch.Generator``.

The per-element spacing comes from the exponent bits of ``v`` (see :func:`binade_`).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

__all__ = [
    "FloatBits",
    "Rounding",
    "binade_",
    "clear_low_bits_",
    "e8m0_decode",
    "e8m0_encode",
    "e8m0_pow2",
    "float_bits",
    "round_to_grid_",
    "uniform_noise_",
    "work_dtype",
]


class Rounding(str, enum.Enum):
    """How a value between two grid points is resolved."""

    NEAREST = "nearest"
    """Round to the nearest grid point, ties to the even one (IEEE default)."""
    STOCHASTIC = "stochastic"
    """Round up with probability equal to the distance from the lower point (unbiased)."""


class FloatBits(NamedTuple):
    """IEEE-754 bit layout of a work dtype."""

    int_dtype: torch.dtype
    """Signed integer dtype of the same width (for ``Tensor.view``)."""
    mantissa_bits: int
    """Stored mantissa bits (23 for float32, 52 for float64)."""
    bias: int
    """Exponent bias (127 / 1023)."""
    exp_mask: int
    """Mask of the exponent field."""


_FLOAT_BITS = {
    torch.float32: FloatBits(torch.int32, 23, 127, 0x7F800000),
    torch.float64: FloatBits(torch.int64, 52, 1023, 0x7FF0000000000000),
}


def float_bits(dtype: torch.dtype) -> FloatBits:
    """Bit layout of ``dtype`` (float32 or float64)."""
    return _FLOAT_BITS[dtype]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype quantization runs in: float64 for float64 inputs, else float32.

    float16 and bfloat16 values are exactly representable in float32, so working in
    float32 loses nothing for them.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def binade_(w: torch.Tensor, out: torch.Tensor, emin: int) -> torch.Tensor:
    """``2**max(floor(log2|w|), emin)`` per element, computed into ``out`` (an integer
    tensor of ``w``'s shape and width) and returned as a float view of it.

    This is the start of the binade each value falls in, floored at the element type's
    smallest normal exponent ``emin`` (below it, subnormals share the spacing of the first
    binade). Two integer passes: mask the exponent field, clamp it from below.
    """
    fb = _FLOAT_BITS[w.dtype]
    torch.bitwise_and(w.view(fb.int_dtype), fb.exp_mask, out=out)
    out.clamp_(min=(emin + fb.bias) << fb.mantissa_bits)
    return out.view(w.dtype)


def round_to_grid_(
    w: torch.Tensor,
    binade: torch.Tensor | float,
    mbits: int,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round ``w`` in place to multiples of ``u = binade * 2**-mbits``.

    ``binade`` is a tensor of powers of two shaped like ``w`` (see :func:`binade_`) or a
    Python float for a fixed spacing (integers: ``binade=1.0, mbits=0``). With ``noise``
    (uniform ``[0, 1)``, see :func:`uniform_noise_`) the rounding is stochastic, otherwise
    nearest-even. The sign of a zero result is not preserved (callers restore it).
    """
    if noise is not None:
        u = binade * 2.0**-mbits
        return w.div_(u).add_(noise).floor_().mul_(u)
    if isinstance(binade, float) and binade == 1.0 and mbits == 0:
        return w.round_()  # torch.round is round-half-to-even
    magic = 1.5 * 2.0 ** (_FLOAT_BITS[w.dtype].mantissa_bits - mbits)
    if isinstance(binade, float):
        return w.add_(magic * binade).sub_(magic * binade)
    return w.add_(binade, alpha=magic).sub_(binade, alpha=magic)


def uniform_noise_(
    out: torch.Tensor, int_bits: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Fill ``out`` with uniform ``[0, 1)`` noise on a grid of ``2**(int_bits - P)``.

    ``P`` is the work dtype's precision (24 / 53). ``int_bits`` bounds the integer part of
    ``|v / u|`` for the element type, so that ``v / u + noise`` is an exact sum and
    stochastic rounding never moves a value that is already on the grid. The noise is
    ``k / 2**bits`` with ``k`` the low bits of the generator's 64-bit draws (two values per
    draw for float32: the CPU generator's cost is per draw).
    """
    bits = _FLOAT_BITS[out.dtype].mantissa_bits + 1 - int_bits
    device = generator.device if generator is not None else out.device
    n = out.numel()
    if bits <= 31:
        draws = torch.empty((n + 1) // 2, dtype=torch.int64, device=device)
        draws = draws.random_(generator=generator).view(torch.int32)[:n]
    else:
        draws = torch.empty(n, dtype=torch.int64, device=device).random_(generator=generator)
    draws.bitwise_and_((1 << bits) - 1)
    return out.copy_(draws.view(out.shape)).mul_(2.0**-bits)


def clear_low_bits_(d: torch.Tensor, k: int) -> torch.Tensor:
    """Clear the ``k`` lowest mantissa bits of non-negative finite ``d`` in place (round
    toward zero to ``k`` fewer significand bits). Used to make amax scales exactly
    invertible: see :class:`.scaling.AmaxScaling`."""
    if k > 0:
        d.view(_FLOAT_BITS[d.dtype].int_dtype).bitwise_and_(~((1 << k) - 1))
    return d


def e8m0_pow2(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """The OCP MX shared scale ``2**s``, ``s = clamp(floor(log2 amax) - emax, -127, 127)``,
    from the exponent bits of a non-negative finite ``amax`` (zero and subnormal amaxes
    count as exponent -127, as in torchao). Exact, in ``amax``'s dtype, five small ops.

    Built as ``2**(s+1) / 2`` so that the subnormal ``2**-127`` needs no special case.
    """
    fb = _FLOAT_BITS[amax.dtype]
    k = torch.bitwise_right_shift(amax.view(fb.int_dtype), fb.mantissa_bits)  # biased exponent
    k.add_(1 - emax).clamp_(fb.bias - 126, fb.bias + 128)  # biased (s + 1)
    return k.bitwise_left_shift_(fb.mantissa_bits).view(amax.dtype).mul_(0.5)


def e8m0_encode(pow2: torch.Tensor) -> torch.Tensor:
    """The E8M0 byte (biased exponent ``s + 127``, uint8) of each power of two ``2**s``
    (``s`` in ``[-127, 127]``) in a float32 / float64 tensor, as :func:`e8m0_pow2` makes
    them. Read off the exponent field: float32's subnormal ``2**-127`` has field 0."""
    fb = _FLOAT_BITS[pow2.dtype]
    field = torch.bitwise_right_shift(pow2.view(fb.int_dtype), fb.mantissa_bits)
    return field.sub_(fb.bias - 127).to(torch.uint8)


def e8m0_decode(code: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2**(code - 127)`` in ``dtype`` (float32 / float64) for E8M0 bytes 0..254, exactly
    (:func:`e8m0_encode` reversed; byte 0 is float32's subnormal ``2**-127``)."""
    fb = _FLOAT_BITS[dtype]
    biased = code.to(fb.int_dtype).add_(fb.bias - 127)
    value = biased.clamp(min=1).bitwise_left_shift_(fb.mantissa_bits).view(dtype)
    return torch.where(biased == 0, 2.0**-127, value)
