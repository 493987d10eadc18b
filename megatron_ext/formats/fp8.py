"""FP8 operands for a real FP8 GEMM: E4M3 / E5M2 data and float32 block scales.

A hardware FP8 GEMM (``torch._scaled_mm``, Transformer Engine) reads each operand as FP8
values ``q`` plus float32 dequantization scales ``d``, one per block along the GEMM's
reduction axis, and computes ``sum_k (q_a d_a)(q_b d_b)`` with an FP32 accumulator.
:func:`to_fp8` produces exactly that pair for the amax-scaled FP8 formats — ``fp8_e4m3`` /
``fp8_e5m2`` with ``@tensor``, ``@row``, ``@tile128`` or ``@block128`` scaling, nearest
rounding — with the numerics of :func:`~megatron_ext.formats.quantize`:
``d = amax / max`` (low significand bits cleared), ``q = round(x * (1/d))`` on the element
grid, so ``q * d == fake_quant(x)`` in float32 and ``q`` is the FP8 code byte that
``quantize`` stores, bit for bit.

The data is laid out as the GEMM wants it: a 2-D ``(rows, cols)`` row-major tensor with the
reduction axis innermost (``cols``); ``scale`` is ``(rows // block_rows, cols // block_cols)``
(``(1, 1)`` per tensor, ``(rows, 1)`` per row). The input may be a transposed view (wgrad
reads ``dy.T`` and ``x.T``): it is read in place and the data written transposed.

Speed: on CUDA, 1x128 tiles, 128x128 blocks and per-row scales of a row-major operand with
rows of up to 8,192 values take one Triton pass (:mod:`.triton_fp8`: amax, factors, rounding,
one byte written per value); per-tensor scales and other per-row ones take two — a read-only
amax reduction (``vector_norm(ord=inf)``, no temporary) and a fused scale-round-cast kernel;
elsewhere three torch ops follow the reduction. :func:`to_fp8_pair` quantizes an operand that
two GEMMs read along different axes (a per-tensor ``x``, ``dy`` or weight) for both: on CUDA
with a per-tensor scale the cast kernel writes the row-major values and their transpose in
its one pass (two launches for both layouts), otherwise the transpose is a copy. The reduction's
amax is *not* finite-filtered (the one-pass kernel's is): an operand holding NaN or inf then
gets a non-finite scale, so the GEMM's output is non-finite as the emulated GEMM's is, but
not equal to it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .registry import Format
from .scaling import AmaxScaling

__all__ = ["FP8_DTYPES", "Fp8Operand", "block_shape", "is_fp8_format", "to_fp8", "to_fp8_pair",
           "transposed"]

ROW_MAX = 8192
"""The longest row whose per-row scale the one-pass kernel makes (the values a program of
``triton_kernels`` holds, ``TILE_ELEMS``; longer rows, and a transposed operand's, take the
two passes)."""
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""torch dtype of each FP8 element type (the OCP bit patterns :mod:`.codes` stores)."""


class Fp8Operand(NamedTuple):
    """One GEMM operand in FP8: values ``data * scale`` per block."""

    data: torch.Tensor
    """``(rows, cols)`` row-major, ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``."""
    scale: torch.Tensor
    """float32 ``d`` per block: ``(rows // block_rows, cols // block_cols)``."""
    fmt: Format
    """The format it was quantized in."""


def is_fp8_format(fmt: Format | None) -> bool:
    """Whether ``fmt`` is one :func:`to_fp8` makes: FP8 element, amax scaling, nearest."""
    return (fmt is not None and fmt.element.name in FP8_DTYPES and not fmt.stochastic
            and isinstance(fmt.scaling, AmaxScaling))


def block_shape(fmt: Format, rows: int, cols: int) -> tuple[int, int]:
    """``(block_rows, block_cols)`` of ``fmt``'s scale blocks on a ``rows x cols`` operand."""
    s = fmt.scaling
    return (rows if s.rows is None else s.rows), (cols if s.cols is None else s.cols)


def to_fp8(t: torch.Tensor, fmt: Format, tensor_amax: torch.Tensor | None = None) -> Fp8Operand:
    """``t`` (2-D, blocks along dim 1, row-major or a transposed view) as an :class:`Fp8Operand`.

    ``tensor_amax``: the whole tensor's amax when ``t`` is a shard of a per-tensor-scaled
    operand (see ``precision.gemm.whole_tensor_amax``). Block sizes must divide the shape.
    """
    br, bc = _checked_blocks(t, fmt)
    if t.is_cuda and _one_pass(fmt, t):
        from .triton_fp8 import quantize_blocks

        return Fp8Operand(*quantize_blocks(t, fmt, FP8_DTYPES[fmt.element.name]), fmt)
    amax = _block_amax(t, br, bc) if tensor_amax is None else tensor_amax.reshape(1, 1)
    dtype = FP8_DTYPES[fmt.element.name]
    if t.is_cuda:  # factors, rounding and cast in one kernel after the reduction
        from .triton_fp8 import scale_and_cast

        return Fp8Operand(*scale_and_cast(t, amax, br, bc, fmt.element, dtype), fmt)
    factors = fmt.scaling.factors(amax.float(), fmt.element)
    return Fp8Operand(_scale_and_cast(t, factors.quant, br, bc, fmt.element, dtype),
                      factors.dequant.contiguous(), fmt)


def to_fp8_pair(t: torch.Tensor, fmt: Format,
                tensor_amax: torch.Tensor | None = None) -> tuple[Fp8Operand, Fp8Operand]:
    """``(to_fp8(t), transposed(to_fp8(t)))`` for a format whose blocks ignore the axis (one
    scale per tensor, square blocks): the operand of both GEMMs that read ``t``, the second
    one reducing along ``t``'s other axis. On CUDA a per-tensor scale's cast writes both
    layouts in its one pass; otherwise the transpose is a copy of the FP8 values."""
    br, bc = _checked_blocks(t, fmt)
    if br != bc and (br, bc) != t.shape:
        raise ValueError(f"{fmt}: the transpose of {br}x{bc} blocks is another quantization")
    if not (t.is_cuda and fmt.scaling.rows is None and fmt.scaling.cols is None):
        op = to_fp8(t, fmt, tensor_amax)
        return op, transposed(op)
    from .triton_fp8 import scale_and_cast

    amax = _block_amax(t, br, bc) if tensor_amax is None else tensor_amax.reshape(1, 1)
    data, scale, data_t = scale_and_cast(t, amax, br, bc, fmt.element,
                                         FP8_DTYPES[fmt.element.name], with_transpose=True)
    return Fp8Operand(data, scale, fmt), Fp8Operand(data_t, scale, fmt)


def transposed(op: Fp8Operand) -> Fp8Operand:
    """``op`` quantized along its other axis, for a format whose blocks ignore the axis: the
    same values and scales, transposed (one byte a value copied, no second quantization)."""
    return Fp8Operand(op.data.t().contiguous(), op.scale.t().contiguous(), op.fmt)


def _checked_blocks(t: torch.Tensor, fmt: Format) -> tuple[int, int]:
    """``fmt``'s ``(block_rows, block_cols)`` on ``t``; ValueError unless ``fmt`` is one
    :func:`to_fp8` makes and its blocks divide ``t``."""
    if not is_fp8_format(fmt):
        raise ValueError(f"{fmt} is not an amax-scaled FP8 format with nearest rounding")
    rows, cols = t.shape
    br, bc = block_shape(fmt, rows, cols)
    if rows % br or cols % bc:
        raise ValueError(f"{fmt}: blocks {br}x{bc} do not divide a {rows}x{cols} operand")
    return br, bc


def _one_pass(fmt: Format, t: torch.Tensor) -> bool:
    """Whether the one-pass kernel takes ``t``: tiles and blocks up to 128 wide, and per-row
    scales of a row-major operand whose rows fit one program (:data:`ROW_MAX`)."""
    s = fmt.scaling
    if s.cols is not None:
        return s.cols <= 128
    return s.rows == 1 and t.stride(1) == 1 and t.shape[1] <= ROW_MAX


def _block_amax(t: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Largest magnitude per ``br x bc`` block (in ``t``'s dtype), one read-only pass."""
    rows, cols = t.shape
    transposed = not t.is_contiguous() and t.t().is_contiguous()
    base = t.t() if transposed else t.contiguous()
    if transposed:  # blocks of t are (bc x br) blocks of its contiguous transpose
        rows, cols, br, bc = cols, rows, bc, br
    blocks = base.view(rows // br, br, cols // bc, bc)
    amax = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=(1, 3))
    return amax.t() if transposed else amax


def _scale_and_cast(t, quant, br, bc, element, dtype) -> torch.Tensor:
    """``round(t * quant)`` on ``element``'s grid, saturated, as FP8 ``(rows, cols)``."""
    rows, cols = t.shape
    v = t.float().contiguous().view(rows // br, br, cols // bc, bc)
    v = v * quant.view(rows // br, 1, -1, 1)
    v = v.clamp_(-element.max, element.max).view(rows, cols)
    return v.to(dtype).contiguous()
