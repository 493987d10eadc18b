"""Element types: the grid of values one stored number can take.

Three families, one rounding routine (:mod:`.rounding`):

* :class:`FloatElement` — a small float ``E<e>M<m>``: sign, ``e`` exponent bits with bias
  ``2**(e-1) - 1``, ``m`` mantissa bits, subnormals below ``2**emin``, and a largest finite
  magnitude ``max`` given explicitly (the OCP 8-bit E4M3 spends its top code on NaN, so its
  max is 448, not 480; the MX FP6/FP4 types have no inf/NaN at all). Rounded by hand on the
  float32 bit pattern, exactly as a correctly rounded cast with saturation would
  (``torch.float8_*`` casts are used as an independent check in the tests).
* :class:`IntElement` — a symmetric integer ``[-(2**(b-1) - 1), 2**(b-1) - 1]``.
* :class:`CastElement` — an IEEE dtype torch has (float32, bfloat16, float16): a plain cast,
  IEEE semantics (overflow to inf, no saturation), nearest-even only.

=========  ====  ==========  ====  =====================================
name       bits  max         emin  grid near 1.0
=========  ====  ==========  ====  =====================================
fp8_e4m3   8     448         -6    1, 1.125, 1.25, ...
fp8_e5m2   8     57344       -14   1, 1.25, 1.5, 1.75
fp6_e3m2   6     28          -2    1, 1.25, 1.5, 1.75
fp6_e2m3   6     7.5         0     1, 1.125, 1.25, ...
fp4_e2m1   4     6           0     0, 0.5, 1, 1.5, 2, 3, 4, 6 (all of it)
int8       8     127               integers
int4       4     7                 integers
=========  ====  ==========  ====  =====================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .rounding import binade_, float_bits, round_to_grid_

__all__ = [
    "ELEMENTS",
    "CastElement",
    "ElementType",
    "FloatElement",
    "IntElement",
    "get_element",
]


@dataclass(frozen=True)
class ElementType:
    """Base class: a grid of representable values and how to round onto it."""

    name: str
    """Registry name, e.g. ``"fp8_e4m3"``; the part of a format name before ``@``."""
    bits: int
    """Storage bits of one element (4, 6, 8, 16, 32)."""
    max: float
    """Largest finite magnitude. Scaled formats map a block's amax onto it."""

    #: Whether stochastic rounding is defined for this element type.
    supports_stochastic = True
    #: Whether a scaling may be attached (casts are used unscaled).
    supports_scaling = True

    def round_(
        self,
        w: torch.Tensor,
        scratch: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        saturate: bool = True,
    ) -> torch.Tensor:
        """Round the float32/float64 work tensor ``w`` onto the grid in place.

        ``scratch`` is an integer tensor of ``w``'s shape and width that may be clobbered
        (allocated when ``None``); ``noise`` switches to stochastic rounding (see
        :func:`.rounding.uniform_noise_`). Values beyond ``max`` saturate to ``±max``;
        ``saturate=False`` skips that pass, for callers that guarantee nearest rounding
        cannot leave the grid (no ``|w|`` reaches ``max`` plus half the top grid step).
        """
        raise NotImplementedError

    @property
    def noise_int_bits(self) -> int:
        """Bits of the integer part of ``|v / u|`` (``u`` = grid step at ``v``)."""
        raise NotImplementedError

    def magnitude_codes(self, a: torch.Tensor) -> torch.Tensor:
        """The stored code of each magnitude in ``a`` (a float32 / float64 tensor of
        non-negative grid values, at most ``max``), as an integer tensor below the sign bit
        (see :mod:`.codes`)."""
        raise NotImplementedError

    def magnitude_values(self) -> list[float]:
        """The magnitude each code ``0 .. 2**(bits-1) - 1`` stands for; NaN for the codes
        quantization never produces (E4M3's 480 is OCP's NaN)."""
        raise NotImplementedError

    @property
    def emax(self) -> int:
        """``floor(log2(max))``: the exponent of the largest binade (used by MX)."""
        return math.frexp(self.max)[1] - 1

    @property
    def max_significand_bits(self) -> int:
        """Significant bits of ``max`` (448 = 0b111 * 2**6 has 3)."""
        mant = math.frexp(self.max)[0]
        while mant != int(mant):
            mant *= 2
        return int(mant).bit_length()


@dataclass(frozen=True)
class FloatElement(ElementType):
    """A small binary float with ``ebits`` exponent and ``mbits`` mantissa bits."""

    ebits: int = 0
    """Exponent bits; the bias is ``2**(ebits-1) - 1``."""
    mbits: int = 0
    """Stored mantissa bits (the grid has ``2**mbits`` steps per binade)."""

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number, ``1 - bias``."""
        return 2 - 2 ** (self.ebits - 1)

    @property
    def noise_int_bits(self) -> int:
        return self.mbits + 1

    def round_(self, w, scratch=None, noise=None, saturate=True):
        if saturate or noise is not None:
            w.clamp_(-self.max, self.max)
        if scratch is None:
            scratch = torch.empty_like(w, dtype=_int_like(w.dtype))
        binade = binade_(w, scratch, self.emin)
        return round_to_grid_(w, binade, self.mbits, noise)

    def magnitude_codes(self, a):
        """Exponent field then mantissa field, the OCP bit pattern. A normal value's code is
        its work-dtype bit pattern shifted right and rebiased; a subnormal's (below
        ``2**emin``) is its count of steps ``2**(emin - mbits)``, less than ``2**mbits``.

        Both are computed for every value and the larger kept (no slow ``where``): for a
        normal value the shifted bits give at least ``2**mbits`` and the step count is
        capped below that; for a subnormal one the shifted bits of its float32 exponent
        below ``emin`` come out smaller than its step count (negative for all but the top
        binade, ``2k - 2**mbits < k`` there)."""
        fb = float_bits(a.dtype)
        codes = torch.bitwise_right_shift(a.view(fb.int_dtype), fb.mantissa_bits - self.mbits)
        codes.sub_((fb.bias + self.emin - 1) << self.mbits)
        steps = (a * 2.0 ** (self.mbits - self.emin)).clamp_(max=2**self.mbits - 1)
        return torch.maximum(codes, steps.to(fb.int_dtype), out=codes)

    def magnitude_values(self):
        step = 2.0 ** (self.emin - self.mbits)
        values = []
        for code in range(2 ** (self.bits - 1)):
            exp, man = code >> self.mbits, code % 2**self.mbits
            value = man * step if exp == 0 else (2**self.mbits + man) * step * 2.0 ** (exp - 1)
            values.append(value if value <= self.max else math.nan)
        return values


@dataclass(frozen=True)
class IntElement(ElementType):
    """A symmetric signed integer: ``max = 2**(bits-1) - 1`` (no ``-2**(bits-1)``)."""

    @property
    def noise_int_bits(self) -> int:
        return self.bits - 1

    def round_(self, w, scratch=None, noise=None, saturate=True):
        if saturate or noise is not None:
            w.clamp_(-self.max, self.max)
        return round_to_grid_(w, 1.0, 0, noise)

    def magnitude_codes(self, a):
        """The magnitude as an unsigned integer: codes are sign-magnitude, which holds the
        symmetric range exactly and keeps a zero's sign."""
        return a.to(float_bits(a.dtype).int_dtype)

    def magnitude_values(self):
        return [float(k) if k <= self.max else math.nan for k in range(2 ** (self.bits - 1))]


@dataclass(frozen=True)
class CastElement(ElementType):
    """An IEEE dtype torch can cast to; rounding is the cast itself."""

    dtype: torch.dtype = torch.float32
    """The torch dtype cast through."""

    supports_stochastic = False
    supports_scaling = False

    @property
    def noise_int_bits(self) -> int:
        raise ValueError(f"{self.name} has no stochastic rounding")

    def magnitude_codes(self, a):
        raise ValueError(f"{self.name} is a plain cast; it is stored as a {self.dtype} tensor")

    def magnitude_values(self):
        raise ValueError(f"{self.name} is a plain cast; it is stored as a {self.dtype} tensor")

    def round_(self, w, scratch=None, noise=None, saturate=True):
        if noise is not None:
            raise ValueError(f"{self.name} has no stochastic rounding")
        if torch.finfo(self.dtype).bits < torch.finfo(w.dtype).bits:
            w.copy_(w.to(self.dtype))
        return w


def _int_like(dtype: torch.dtype) -> torch.dtype:
    return torch.int64 if dtype == torch.float64 else torch.int32


def _float(name: str, bits: int, ebits: int, mbits: int, max_: float) -> FloatElement:
    return FloatElement(name=name, bits=bits, max=max_, ebits=ebits, mbits=mbits)


ELEMENTS: dict[str, ElementType] = {
    e.name: e
    for e in (
        CastElement(name="fp32", bits=32, max=torch.finfo(torch.float32).max, dtype=torch.float32),
        CastElement(
            name="bf16", bits=16, max=torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16
        ),
        CastElement(name="fp16", bits=16, max=torch.finfo(torch.float16).max, dtype=torch.float16),
        _float("fp8_e4m3", 8, 4, 3, 448.0),
        _float("fp8_e5m2", 8, 5, 2, 57344.0),
        _float("fp6_e3m2", 6, 3, 2, 28.0),
        _float("fp6_e2m3", 6, 2, 3, 7.5),
        _float("fp4_e2m1", 4, 2, 1, 6.0),
        IntElement(name="int8", bits=8, max=127.0),
        IntElement(name="int4", bits=4, max=7.0),
    )
}
"""Every element type by name."""


def get_element(name: str) -> ElementType:
    """The element type called ``name``; ``ValueError`` listing the known ones otherwise."""
    try:
        return ELEMENTS[name]
    except KeyError:
        raise ValueError(f"unknown element type {name!r}; known: {', '.join(ELEMENTS)}") from None
