"""``fake_quant``: layout, blocking and chunking around the element and scaling rules.

The tensor is viewed as 2-D ``(rows, cols)`` with the quantization axis innermost, cut
into row chunks, and each chunk goes through one fixed pipeline of in-place passes::

    amax per block -> factors -> w = x * quant -> round_(w) -> w *= dequant -> sign fix

The first four passes (:func:`rounded_chunks`) are shared with :func:`.quantized.quantize`,
which encodes the rounded grid values and the factors' scales instead of multiplying them
out, so that ``dequantize(quantize(x))`` is ``fake_quant(x)`` bit for bit.

On CPU a chunk is about ``CHUNK_ELEMS`` values so the work tensors stay in cache and
are reused from chunk to chunk (a fresh 64 MiB temporary costs as much as the whole
quantization, in page faults alone). On CUDA the whole tensor is one chunk, and the
Triton kernels (:mod:`.triton_kernels`) take over where they apply.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch

from .amax import block_amax, finite_amax
from .elements import CastElement
from .registry import Format, get_format
from .rounding import uniform_noise_, work_dtype
from .scaling import AmaxScaling, ColScaling, Factors, Scaling

__all__ = ["CHUNK_ELEMS", "RoundedChunk", "fake_quant", "fake_quant_2d", "rounded_chunks"]

CHUNK_ELEMS = 1 << 19
"""Values per chunk on CPU (2 MiB of float32; measured best on a 2-core box)."""

BACKEND_ENV = "MEGATRON_EXT_FORMATS_BACKEND"
"""Set to ``torch`` to keep CUDA tensors on the torch reference (default ``auto``)."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The input dtypes quantization takes."""


@torch.no_grad()
def fake_quant(
    x: torch.Tensor,
    fmt: str | Format,
    *,
    axis: int = -1,
    generator: torch.Generator | None = None,
    tensor_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize ``x`` to ``fmt`` and dequantize it back: same shape, dtype and device.

    ``axis`` is the dimension blocks run along (a GEMM's reduction dimension); the other
    dimensions are flattened into rows (128x128 blocks span 128 of those rows).
    ``generator`` drives stochastic rounding (the default generator when ``None``).
    ``tensor_amax`` replaces ``x``'s own finite amax where the format reads the whole
    tensor's (one scale per tensor, NVFP4's second level): the amax of the whole tensor
    when ``x`` is one shard of it, so that the shard is scaled as the whole would be.
    Not differentiable: wrap it in a straight-through estimator for training.
    """
    fmt = get_format(fmt)
    check_dtype(x, "fake_quant")
    if x.numel() == 0:
        return x.clone()
    x2, axis = to_2d(x, axis)
    if isinstance(fmt.scaling, ColScaling):  # a scale per column: per row of the transpose
        row = dataclasses.replace(fmt, scaling=AmaxScaling(rows=1, cols=None))
        y2 = _dispatch(x2.t().contiguous(), row, generator, tensor_amax).t().contiguous()
        return from_2d(y2, x.shape, axis)
    return from_2d(_dispatch(x2, fmt, generator, tensor_amax), x.shape, axis)


def check_dtype(x: torch.Tensor, caller: str) -> None:
    """``TypeError`` unless ``x`` is a float32 / bfloat16 / float16 / float64 tensor."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{caller} takes float32/bfloat16/float16/float64, got {x.dtype}")


def to_2d(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, int]:
    """The contiguous ``(rows, cols)`` view of ``x`` with ``axis`` moved innermost, and
    ``axis`` made non-negative (``IndexError`` when out of range; a 0-d ``x`` is 1x1)."""
    if x.ndim == 0:
        return x.reshape(1, 1), 0
    axis = range(x.ndim)[axis]
    moved = x.movedim(axis, -1)
    return moved.reshape(math.prod(moved.shape[:-1]), moved.shape[-1]).contiguous(), axis


def from_2d(y2: torch.Tensor, shape: tuple[int, ...], axis: int) -> torch.Tensor:
    """:func:`to_2d` reversed: the ``(rows, cols)`` tensor ``y2`` back to ``shape``."""
    if len(shape) == 0:
        return y2.reshape(())
    shape = tuple(shape)
    y = y2.view(shape[:axis] + shape[axis + 1 :] + shape[axis : axis + 1])
    return y if axis == len(shape) - 1 else y.movedim(-1, axis).contiguous()


def triton_backend(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take ``x``: a CUDA tensor, triton importable, and
    ``BACKEND_ENV`` not ``torch`` (otherwise the torch reference runs on CUDA too)."""
    if not x.is_cuda or os.environ.get(BACKEND_ENV, "auto") == "torch":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _dispatch(x2: torch.Tensor, fmt: Format, generator, tensor_amax) -> torch.Tensor:
    if triton_backend(x2):
        from . import triton_kernels

        if triton_kernels.supports(fmt, x2):
            return triton_kernels.fake_quant_2d(x2, fmt, generator, tensor_amax)
    return fake_quant_2d(x2, fmt, generator, tensor_amax=tensor_amax)


def fake_quant_2d(
    x: torch.Tensor,
    fmt: Format,
    generator: torch.Generator | None = None,
    chunk_elems: int | None = None,
    tensor_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference on a contiguous 2-D tensor, blocks along dim 1 (``tensor_amax``
    as in :func:`fake_quant`)."""
    if isinstance(fmt.element, CastElement):
        y = x.to(fmt.element.dtype).to(x.dtype)
        return y.clone() if y is x else y
    y = torch.empty_like(x)
    for chunk in rounded_chunks(x, fmt, generator, chunk_elems, out=y, tensor_amax=tensor_amax):
        xc, yc = x[chunk.rows], y[chunk.rows]
        if chunk.factors is not None:
            chunk.w4.mul_(chunk.factors.dequant)
        out = chunk.w[:, : x.shape[1]]
        out.copysign_(xc)  # rounding to zero gives +0; keep the input's sign like a real cast
        if not chunk.direct:
            yc.copy_(out)
        if chunk.nonfinite:  # NaN and inf pass through unchanged
            torch.where(torch.isfinite(xc), yc, xc, out=yc)
    return y


class Blocking(NamedTuple):
    """How a ``(rows, cols)`` tensor is cut into scale blocks and row chunks."""

    block_cols: int
    """Columns per block (``cols`` when the scaling spans the whole axis)."""
    padded: int
    """``cols`` rounded up to whole blocks (the width of the work tensors)."""
    group: int
    """Rows per block (1 when the scaling spans all rows)."""
    chunk_rows: int
    """Rows per chunk (a multiple of ``group``)."""

    def chunks(self, rows: int) -> Iterator[tuple[int, int]]:
        """Row ranges of ``chunk_rows``; a ragged tail is split so that each range is whole
        groups or one partial group."""
        r0 = 0
        while r0 < rows:
            r1 = min(r0 + self.chunk_rows, rows)
            if (r1 - r0) % self.group and r1 - r0 > self.group:
                r1 = r0 + (r1 - r0) // self.group * self.group
            yield r0, r1
            r0 = r1

    def shape4(self, rows: int) -> tuple[int, int, int, int]:
        """The blocked view ``(groups, group_rows, blocks, block_cols)`` of a chunk."""
        group = min(self.group, rows)
        return rows // group, group, self.padded // self.block_cols, self.block_cols


def blocking(x: torch.Tensor, scaling: Scaling, chunk_elems: int | None = None) -> Blocking:
    """The :class:`Blocking` of the 2-D ``x`` (CPU: chunks of about ``chunk_elems`` or
    :data:`CHUNK_ELEMS` values; other devices: one chunk)."""
    rows, cols = x.shape
    block_cols = scaling.cols or cols
    padded = -(-cols // block_cols) * block_cols
    group = scaling.rows or 1
    if chunk_elems is None:
        chunk_elems = CHUNK_ELEMS if x.device.type == "cpu" else rows * padded
    chunk_rows = max(group, chunk_elems // max(padded, 1) // group * group)
    return Blocking(block_cols, padded, group, chunk_rows)


class RoundedChunk(NamedTuple):
    """One row chunk after the shared passes (amax, factors, scale, round)."""

    start: int
    """First row of the chunk in the 2-D tensor."""
    w4: torch.Tensor
    """The rounded grid values ``q`` (work dtype), blocked ``(groups, group_rows,
    blocks, block_cols)``, padding columns included; zeros not yet signed."""
    factors: Factors | None
    """The chunk's per-block factors (``None``: unscaled)."""
    nonfinite: bool
    """Whether the chunk (or, for per-tensor scales, the tensor) has NaN or inf."""
    direct: bool
    """Whether ``w4`` is the ``out`` rows themselves (else a work buffer)."""

    @property
    def w(self) -> torch.Tensor:
        """``w4`` as ``(rows, padded)``."""
        return self.w4.view(-1, self.w4.shape[2] * self.w4.shape[3])

    @property
    def rows(self) -> slice:
        """The chunk's rows in the 2-D tensor."""
        return slice(self.start, self.start + self.w4.shape[0] * self.w4.shape[1])


def rounded_chunks(
    x: torch.Tensor,
    fmt: Format,
    generator: torch.Generator | None = None,
    chunk_elems: int | None = None,
    out: torch.Tensor | None = None,
    tensor_amax: torch.Tensor | None = None,
) -> Iterator[RoundedChunk]:
    """Scale and round the contiguous 2-D ``x`` (non-empty, ``fmt`` not a cast) chunk by
    chunk. Each :class:`RoundedChunk` lives in a reused buffer (or in the rows of ``out``,
    a tensor shaped like ``x``, when it fits): finish with it before taking the next.
    ``tensor_amax``: the whole tensor's amax when ``x`` is a shard (:func:`fake_quant`)."""
    scaling = fmt.scaling
    plan = blocking(x, scaling, chunk_elems)
    whole_amax, tensor_amax, nonfinite = tensor_amax, None, False
    if scaling.rows is None or scaling.needs_tensor_amax:
        tensor_amax, nonfinite = finite_amax(x, dims=(0, 1), keepdim=False)
        if whole_amax is not None:
            tensor_amax = whole_amax.to(tensor_amax.dtype).reshape(tensor_amax.shape)
    ws = _Workspace(x.device, plan.chunk_rows * plan.padded)
    for r0, r1 in plan.chunks(x.shape[0]):
        target = None if out is None else out[r0:r1]
        yield _round_rows(x[r0:r1], target, r0, fmt, plan, tensor_amax, nonfinite, ws, generator)


def _round_rows(x, out, start, fmt, plan, tensor_amax, nonfinite, ws, generator) -> RoundedChunk:
    """Scale and round the row chunk ``x`` (whole blocks only), into ``out`` if it can."""
    element, scaling = fmt.element, fmt.scaling
    rows, cols = x.shape
    work = work_dtype(x.dtype)
    shape4 = plan.shape4(rows)
    staged = x.dtype != work or plan.padded != cols
    if staged:  # convert / zero-pad into a work buffer
        w = ws.get("stage", (rows, plan.padded), work)
        w[:, :cols].copy_(x)
        w[:, cols:].zero_()
        src = w
    else:  # compute straight into the output (or a work buffer), reading x
        w = out if out is not None else ws.get("stage", (rows, cols), work)
        src = x
    w4, src4 = w.view(shape4), src.view(shape4)
    scratch = ws.get("scratch", shape4, _int_of(work))
    if scaling.rows is None:
        amax = tensor_amax
    else:
        amax, nonfinite = block_amax(src4, scratch)
    factors = scaling.factors(amax, element, tensor_amax)
    if factors is not None:
        torch.mul(src4, factors.quant, out=w4)
    elif w is not src:
        w.copy_(x)
    noise = None
    if fmt.stochastic:
        noise = uniform_noise_(ws.get("noise", shape4, work), element.noise_int_bits, generator)
    element.round_(w4, scratch, noise, saturate=scaling.overshoots)
    return RoundedChunk(start, w4, factors, nonfinite, direct=w is out)


def _int_of(dtype: torch.dtype) -> torch.dtype:
    return torch.int64 if dtype == torch.float64 else torch.int32


class _Workspace:
    """Flat buffers reused across chunks (allocated once, on first use)."""

    def __init__(self, device: torch.device, numel: int):
        self.device, self.numel, self.buffers = device, numel, {}

    def get(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype:
            buf = self.buffers[name] = torch.empty(self.numel, dtype=dtype, device=self.device)
        n = 1
        for s in shape:
            n *= s
        return buf[:n].view(shape)
