"""Low-precision number formats, fake quantization and real quantized tensors.

A *format* says how a GEMM operand (``x``, ``w`` or ``dy``) is stored in low precision;
``fake_quant(t, fmt)`` returns ``dequantize(quantize(t))`` in ``t``'s own dtype, so a model
can be trained "as if" in that format on any hardware (SNIP §6.1). A format has three
independent parts, each a small class:

**Element type** (:mod:`.elements`) — the grid one stored number can take. A small float
``E<e>M<m>`` stores a sign, ``e`` exponent bits (bias ``2**(e-1) - 1``) and ``m`` mantissa
bits: its values are ``±2**E * (1 + k / 2**m)`` for ``E >= emin = 2 - 2**(e-1)`` and the
subnormals ``±2**emin * k / 2**m``, up to a largest finite ``max`` (E4M3: 448, E5M2:
57344, E3M2: 28, E2M3: 7.5, E2M1: 6 — E2M1's whole grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6).
Near a value ``v`` the grid is evenly spaced with step ``u = 2**(max(E_v, emin) - m)``.
Integers (INT8/INT4, symmetric ±127 / ±7) have ``u = 1``; BF16/FP16/FP32 are plain casts.

**Scaling** (:mod:`.scaling`) — low-precision grids are narrow, so each block of values is
mapped onto the grid by a scale taken from the block's amax (largest finite magnitude).
Blocks run along ``axis``, the GEMM's reduction dimension: ``tensor``, ``row``,
``tile128`` (1x128, DeepSeek-V3's choice for ``x`` and ``dy``), ``block128`` (128x128, for
``w``), ``mx32`` and ``nv16``. With ``x`` quantized as ``q = round(x * quant)`` and returned
as ``q * dequant`` per block:

* amax scaling (tensor/row/tile/block): ``d = amax / max`` in float32 with its last
  ``b`` significand bits cleared, ``b`` being the significand width of ``max`` (3 for
  448), so that ``max * d`` is exact; ``quant = 1/d``, ``dequant = d``. The amax value
  lands on ``max`` and comes back as exactly ``max * d``, so a second quantization
  finds the same ``d``: ``fake_quant`` is idempotent. (SNIP's ``scale = FPX_MAX / amax``,
  up to that 2**-21 rounding of the scale.) ``d >= 2**-126``.
* OCP MX v1.0 (``mx32``): a shared power of two ``2**s`` (an E8M0 byte) with
  ``s = clamp(floor(log2 amax) - emax, -127, 127)``, ``emax = floor(log2 max)``; elements
  then round with saturation at ``max`` (the amax may round above it: ``(6, 8) * 2**s``
  clips to ``6 * 2**s`` in MXFP4). Bit-identical to torchao's MX emulation (FLOOR mode).
* NVFP4 (``nv16``): tensor scale ``t = amax_tensor / (448 * 6)`` (float32), block scale
  ``b = e4m3(clamp(amax_block / 6 / t, 2**-6, 448))``, ``quant = (1/t) / b``,
  ``dequant = t * b``. Bit-identical to torchao's ``nvfp4_quantize`` with a tensor scale.

**Rounding** (:mod:`.rounding`) — nearest-even, or stochastic (``+sr``): ``v`` goes to the
grid point above with probability ``(v - lower) / u``, so ``E[q] = v``; the random numbers
come from the ``generator`` argument (or torch's default generator), so a seed reproduces
a result. Rounding is done by hand on float32 bits: ``(v + C) - C`` with
``C = 1.5 * 2**23 * u`` is the nearest multiple of ``u`` with ties to even (the hardware
add does the rounding), and ``u * floor(v / u + r)`` is the stochastic one.

Special values: NaN and ±inf pass through unchanged, in place; the scale of their block
comes from its finite values. Zeros keep their sign. Finite values never become
non-finite (BF16/FP16 casts aside, which overflow to inf like any cast). Values beyond
the grid saturate to ``±max`` (times the block scale).

Names (:mod:`.registry`): ``<element>@<scaling>[+sr]``, e.g. ``fp8_e4m3@tile128``,
``fp4_e2m1@block128+sr``, ``int8@row``; ``fp8_e4m3`` alone is per tensor; aliases
``mxfp8``, ``mxfp6_e3m2``, ``mxfp6_e2m3``, ``mxfp4``, ``nvfp4``. ``available()`` lists the
registered names and ``get_format(name)`` builds any valid combination.

Real storage (:mod:`.quantized`): ``quantize(t, fmt)`` runs the same passes as
``fake_quant`` but keeps the rounded grid values as packed element codes (:mod:`.codes`:
two FP4/INT4 codes per byte, one byte for 6- and 8-bit elements) and each block's scale in
its real type (float32, E8M0, E4M3 + a float32 tensor scale) in a :class:`QuantizedTensor`;
``dequantize`` gives back exactly ``fake_quant(t, fmt)``, bit for bit.

Backends: a pure-torch reference for every format and device (CPU: in cache-sized
chunks, float32 work, no float64 temporaries); on CUDA, Triton kernels
(:mod:`.triton_kernels`) for the tile/block/MX/NVFP4 formats, bit-identical for
nearest rounding. ``MEGATRON_EXT_FORMATS_BACKEND=torch`` keeps CUDA on the reference.
See ``docs/formats.md`` for the table of formats and the measured throughput.
"""

from .error import error_sums
from .elements import ELEMENTS, CastElement, ElementType, FloatElement, IntElement, get_element
from .pipeline import fake_quant, fake_quant_2d
from .quantized import QuantizedTensor, dequantize, quantize
from .registry import Format, available, get_format, parse_format, register
from .rounding import Rounding
from .scaling import AmaxScaling, Factors, MXScaling, NoScaling, NVScaling, Scaling

__all__ = [
    "ELEMENTS",
    "AmaxScaling",
    "CastElement",
    "ElementType",
    "Factors",
    "FloatElement",
    "Format",
    "IntElement",
    "MXScaling",
    "NVScaling",
    "NoScaling",
    "QuantizedTensor",
    "Rounding",
    "Scaling",
    "available",
    "dequantize",
    "error_sums",
    "fake_quant",
    "fake_quant_2d",
    "get_element",
    "get_format",
    "parse_format",
    "quantize",
    "register",
]
