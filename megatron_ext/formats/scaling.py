"""Scalings: how a block of values is mapped onto an element type's range.

A scaling cuts the 2-D view of a tensor (rows x the reduction axis) into blocks of
``rows x cols`` values, takes each block's amax (largest finite magnitude) and turns it
into two per-block factors: values are quantized as ``round(x * quant)`` and dequantized
as ``q * dequant``. Block shapes:

===========  ==============  ===================================================
name         block           scale
===========  ==============  ===================================================
none         -               1 (the element range is used as is)
tensor       whole tensor    float32 ``d = amax / max``
row          1 x whole axis  float32 ``d`` per row
col          all rows x 1    float32 ``d`` per column: per index of the axis
tile128      1 x 128         float32 ``d`` per tile (DeepSeek-V3: x and dy)
block128     128 x 128       float32 ``d`` per block (DeepSeek-V3: weights)
mx32         1 x 32          E8M0 power of two (OCP MX v1.0)
nv16         1 x 16          E4M3 block scale x float32 tensor scale (NVFP4)
===========  ==============  ===================================================

See the package docstring for the rules each one follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .elements import ElementType, FloatElement, get_element
from .rounding import clear_low_bits_, e8m0_decode, e8m0_encode, e8m0_pow2

__all__ = ["AmaxScaling", "ColScaling", "Factors", "MXScaling", "NVScaling", "NoScaling",
           "Scaling"]


class Factors(NamedTuple):
    """Per-block factors, broadcastable against the blocked view of the data."""

    quant: torch.Tensor
    """Multiply the input by this before rounding."""
    dequant: torch.Tensor
    """Multiply the rounded values by this to get the output."""
    block_scale: torch.Tensor
    """The per-block scale that is stored (work dtype, exact in its storage type):
    ``d``, ``2**s`` or NVFP4's E4M3 ``b``; :meth:`Scaling.dequant` makes ``dequant`` of it."""
    tensor_scale: torch.Tensor | None = None
    """NVFP4's float32 tensor scale ``t`` (``dequant = t * b``); ``None`` for the others."""


@dataclass(frozen=True)
class Scaling:
    """Base class: block geometry plus the amax -> factors rule."""

    rows: int | None = None
    """Block height in rows (``None``: all rows)."""
    cols: int | None = None
    """Block width along the reduction axis (``None``: the whole axis)."""

    #: Storage bits of one scale (for :attr:`Format.effective_bits`).
    scale_bits = 0
    #: Storage dtype of the block scales (``None``: the work dtype, float32 / float64).
    scale_dtype = None
    #: Whether :meth:`factors` also needs the amax of the whole tensor.
    needs_tensor_amax = False
    #: Whether scaled values can exceed the element max by half a grid step or more
    #: (then rounding must saturate explicitly).
    overshoots = True

    @property
    def name(self) -> str:
        """Canonical name, the part of a format name after ``@``."""
        raise NotImplementedError

    @property
    def reads_tensor_amax(self) -> bool:
        """Whether the factors depend on the amax of the whole tensor (one scale per tensor,
        or NVFP4's second level): a shard of a tensor-parallel operand must then be given the
        whole tensor's amax to be scaled as the unsharded tensor is."""
        return self.needs_tensor_amax or (self.rows is None and not isinstance(self, NoScaling))

    def factors(
        self,
        amax: torch.Tensor,
        element: ElementType,
        tensor_amax: torch.Tensor | None = None,
    ) -> Factors | None:
        """Factors from the finite, non-negative block amaxes (work dtype)."""
        raise NotImplementedError

    def dequant(self, block_scale: torch.Tensor, tensor_scale: torch.Tensor | None = None):
        """The dequantization factor of stored scales (one rule for quantize and dequantize)."""
        return block_scale

    def encode_scales(self, block_scale: torch.Tensor) -> torch.Tensor:
        """Block scales in their storage type (float32 / float64 for amax scaling)."""
        return block_scale

    def decode_scales(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored block scales back as ``dtype`` (float32 / float64) values, exactly."""
        return stored.to(dtype)

    def check(self, element: ElementType) -> None:
        """Raise ``ValueError`` if this scaling cannot be used with ``element``."""
        if not element.supports_scaling and not isinstance(self, NoScaling):
            raise ValueError(f"{element.name} is a plain cast; it takes no scaling (@none)")


@dataclass(frozen=True)
class NoScaling(Scaling):
    """Unit scale: values beyond the element's max saturate."""

    @property
    def name(self) -> str:
        return "none"

    def factors(self, amax, element, tensor_amax=None):
        return None


@dataclass(frozen=True)
class AmaxScaling(Scaling):
    """float32 scale per block: ``d = amax / max``, quantize ``x * (1/d)``, dequantize ``q * d``.

    ``d`` loses (rounding toward zero) as many low significand bits as ``max`` has (3 for
    448) so that ``max * d`` is exact: the block's largest value then dequantizes to
    exactly ``max * d``, re-quantizing the output finds the same ``d``, and quantization is
    idempotent. ``d`` is at least the smallest normal float (an all-zero block gets
    ``d = 2**-126``).
    """

    scale_bits = 32
    overshoots = False  # the amax lands within 2**-16 of max, where the grid step is wide

    @property
    def name(self) -> str:
        if self.cols is None:
            return "tensor" if self.rows is None else "row"
        return f"tile{self.cols}" if self.rows == 1 else f"block{self.cols}"

    def factors(self, amax, element, tensor_amax=None):
        # a tensor divisor: CUDA turns division by a Python scalar into a multiplication by
        # its reciprocal, which rounds differently from the CPU's (and the kernels') division
        divisor = torch.full_like(amax, element.max)
        d = clear_low_bits_(amax / divisor, element.max_significand_bits)
        d.clamp_(min=torch.finfo(d.dtype).tiny)
        return Factors(quant=d.reciprocal(), dequant=self.dequant(d), block_scale=d)


@dataclass(frozen=True)
class ColScaling(AmaxScaling):
    """``row``'s float32 scale turned across: one per *column* of the 2-D view, i.e. per index
    of the quantization axis, taken over all the other dimensions (``@col``). For wgrad's
    ``x``, quantized along the tokens, that is one scale per token — the token-wise
    activation quantization of GNMR §5.1 — whereas ``row`` there is one per input feature.
    :func:`~.pipeline.fake_quant` runs it as ``row`` on the transposed view; it has no
    packed storage (:func:`~.quantized.quantize` refuses it)."""

    @property
    def name(self) -> str:
        return "col"


@dataclass(frozen=True)
class MXScaling(Scaling):
    """OCP MX v1.0: shared scale ``2**s`` with ``s = floor(log2(amax)) - emax_elem``.

    ``s`` is clamped to the E8M0 range ``[-127, 127]``; elements are then rounded with
    saturation to the element max. This is torchao's ``ScaleCalculationMode.FLOOR``.
    """

    rows: int | None = 1
    cols: int | None = 32
    scale_bits = 8
    scale_dtype = torch.uint8

    @property
    def name(self) -> str:
        return f"mx{self.cols}"

    def check(self, element):
        _require_float(self, element)

    def factors(self, amax, element, tensor_amax=None):
        scale = e8m0_pow2(amax, element.emax)
        return Factors(quant=scale.reciprocal(), dequant=self.dequant(scale), block_scale=scale)

    def encode_scales(self, block_scale):
        """One E8M0 byte per block: the biased exponent ``s + 127``."""
        return e8m0_encode(block_scale)

    def decode_scales(self, stored, dtype):
        return e8m0_decode(stored, dtype)


@dataclass(frozen=True)
class NVScaling(Scaling):
    """NVFP4 two-level scaling (as NVIDIA's recipe and torchao's ``nvfp4_quantize``).

    Tensor scale ``t = amax_tensor / (448 * max)`` (float32); block scale
    ``b = e4m3(clamp(amax_block / max / t, 2**-6, 448))``; quantize ``x * ((1/t) / b)``,
    dequantize ``q * (t * b)``. ``t`` is at least ``2**6`` times the smallest normal float
    (``2**-120``) so that ``(1/t) / b`` stays finite (an all-zero tensor gives zeros).
    """

    rows: int | None = 1
    cols: int | None = 16
    scale_bits = 8
    scale_dtype = torch.uint8
    needs_tensor_amax = True

    @property
    def name(self) -> str:
        return f"nv{self.cols}"

    def check(self, element):
        _require_float(self, element)

    def factors(self, amax, element, tensor_amax=None):
        e4m3 = get_element("fp8_e4m3")
        b_min = 2.0**e4m3.emin
        t = (tensor_amax / (e4m3.max * element.max)).clamp_(
            min=torch.finfo(amax.dtype).tiny / b_min
        )
        b = (amax / element.max / t).clamp_(min=b_min, max=e4m3.max)
        e4m3.round_(b)
        return Factors(
            quant=t.reciprocal() / b, dequant=self.dequant(b, t), block_scale=b, tensor_scale=t
        )

    def dequant(self, block_scale, tensor_scale=None):
        return tensor_scale * block_scale

    def encode_scales(self, block_scale):
        """One E4M3 byte per block (the OCP bit pattern; ``b`` is positive)."""
        return get_element("fp8_e4m3").magnitude_codes(block_scale).to(torch.uint8)

    def decode_scales(self, stored, dtype):
        values = get_element("fp8_e4m3").magnitude_values()
        return torch.tensor(values, dtype=dtype, device=stored.device)[stored.long()]


def _require_float(scaling: Scaling, element: ElementType) -> None:
    if not isinstance(element, FloatElement):
        raise ValueError(f"@{scaling.name} needs a small float element type, not {element.name}")  # noqa: TRY004
