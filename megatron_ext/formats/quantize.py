"""``fake_quant``: layout, blocking and chunking around the element and scaling rules.

The tensor is viewed as 2-D ``(rows, cols)`` with the quantization axis innermost, cut
into row chunks, and each chunk goes through one fixed pipeline of in-place passes::

    amax per block -> factors -> w = x * quant -> round_(w) -> w *= dequant -> sign fix

On CPU a chunk is about ``CHUNK_ELEMS`` values so the work tensors stay in cache and
are reused from chunk to chunk (a fresh 64 MiB temporary costs as much as the whole
quantization, in page faults alone). On CUDA the whole tensor is one chunk, and the
Triton kernels (:mod:`.triton_kernels`) take over where they apply.
"""

from __future__ import annotations

import math
import os

import torch

from .elements import CastElement
from .registry import Format, get_format
from .rounding import uniform_noise_, work_dtype

__all__ = ["CHUNK_ELEMS", "fake_quant", "fake_quant_2d"]

CHUNK_ELEMS = 1 << 19
"""Values per chunk on CPU (2 MiB of float32; measured best on a 2-core box)."""

BACKEND_ENV = "MEGATRON_EXT_FORMATS_BACKEND"
"""Set to ``torch`` to keep CUDA tensors on the torch reference (default ``auto``)."""

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@torch.no_grad()
def fake_quant(
    x: torch.Tensor,
    fmt: str | Format,
    *,
    axis: int = -1,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Quantize ``x`` to ``fmt`` and dequantize it back: same shape, dtype and device.

    ``axis`` is the dimension blocks run along (a GEMM's reduction dimension); the other
    dimensions are flattened into rows (128x128 blocks span 128 of those rows).
    ``generator`` drives stochastic rounding (the default generator when ``None``).
    Not differentiable: wrap it in a straight-through estimator for training.
    """
    fmt = get_format(fmt)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"fake_quant takes float32/bfloat16/float16/float64, got {x.dtype}")
    if x.numel() == 0:
        return x.clone()
    if x.ndim == 0:
        return fake_quant(x.reshape(1), fmt, generator=generator).reshape(())
    axis = range(x.ndim)[axis]  # IndexError for an axis out of range
    moved = x.movedim(axis, -1)
    x2 = moved.reshape(-1, moved.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = _dispatch(x2, fmt, generator).view(moved.shape)
    return y if axis == x.ndim - 1 else y.movedim(-1, axis).contiguous()


def _dispatch(x2: torch.Tensor, fmt: Format, generator) -> torch.Tensor:
    if x2.is_cuda and os.environ.get(BACKEND_ENV, "auto") != "torch":
        try:
            from . import triton_kernels
        except ImportError:  # no triton: the torch reference runs on CUDA too
            triton_kernels = None
        if triton_kernels is not None and triton_kernels.supports(fmt, x2):
            return triton_kernels.fake_quant_2d(x2, fmt, generator)
    return fake_quant_2d(x2, fmt, generator)


def fake_quant_2d(
    x: torch.Tensor,
    fmt: Format,
    generator: torch.Generator | None = None,
    chunk_elems: int | None = None,
) -> torch.Tensor:
    """The torch reference on a contiguous 2-D tensor, blocks along dim 1."""
    element, scaling = fmt.element, fmt.scaling
    if isinstance(element, CastElement):
        y = x.to(element.dtype).to(x.dtype)
        return y.clone() if y is x else y
    rows, cols = x.shape
    block_cols = scaling.cols or cols
    padded = -(-cols // block_cols) * block_cols
    group = scaling.rows or 1
    if chunk_elems is None:
        chunk_elems = CHUNK_ELEMS if x.device.type == "cpu" else rows * padded
    chunk_rows = max(group, chunk_elems // padded // group * group)
    tensor_amax, nonfinite = None, False
    if scaling.rows is None or scaling.needs_tensor_amax:
        tensor_amax, nonfinite = _finite_amax(x, dims=(0, 1), keepdim=False)
    y = torch.empty_like(x)
    ws = _Workspace(x.device, chunk_rows * padded)
    for r0, r1 in _row_chunks(rows, group, chunk_rows):
        _quantize_rows(x[r0:r1], y[r0:r1], fmt, tensor_amax, nonfinite, ws, generator)
    return y


def _row_chunks(rows: int, group: int, chunk_rows: int):
    """Row ranges of ``chunk_rows`` (a multiple of ``group``); a ragged tail is split so
    that each range is whole groups or one partial group."""
    r0 = 0
    while r0 < rows:
        r1 = min(r0 + chunk_rows, rows)
        if (r1 - r0) % group and r1 - r0 > group:
            r1 = r0 + (r1 - r0) // group * group
        yield r0, r1
        r0 = r1


def _quantize_rows(x, y, fmt, tensor_amax, nonfinite, ws, generator):
    """Quantize-dequantize the row chunk ``x`` into ``y`` (whole blocks only)."""
    element, scaling = fmt.element, fmt.scaling
    rows, cols = x.shape
    work = work_dtype(x.dtype)
    group = min(scaling.rows or 1, rows)
    block_cols = scaling.cols or cols
    padded = -(-cols // block_cols) * block_cols
    shape4 = (rows // group, group, padded // block_cols, block_cols)
    staged = x.dtype != work or padded != cols
    if staged:  # convert / zero-pad into a work buffer
        w = ws.get("stage", (rows, padded), work)
        w[:, :cols].copy_(x)
        w[:, cols:].zero_()
        src = w
    else:  # compute straight into the output
        w, src = y, x
    w4, src4 = w.view(shape4), src.view(shape4)
    scratch = ws.get("scratch", shape4, _int_of(work))
    if scaling.rows is None:
        amax = tensor_amax
    else:
        amax, nonfinite = _block_amax(src4, scratch)
    factors = scaling.factors(amax, element, tensor_amax)
    if factors is not None:
        torch.mul(src4, factors.quant, out=w4)
    elif not staged:
        w.copy_(x)
    noise = None
    if fmt.stochastic:
        noise = uniform_noise_(ws.get("noise", shape4, work), element.noise_int_bits, generator)
    element.round_(w4, scratch, noise, saturate=scaling.overshoots)
    if factors is not None:
        w4.mul_(factors.dequant)
    out = w[:, :cols] if staged else w
    out.copysign_(x)  # rounding to zero gives +0; keep the input's sign like a real cast
    if staged:
        y.copy_(out)
    if nonfinite:  # NaN and inf pass through unchanged
        torch.where(torch.isfinite(x), y, x, out=y)


def _finite_amax(v: torch.Tensor, dims: tuple[int, ...], keepdim: bool = True):
    """Largest finite magnitude of ``v`` over ``dims`` (work dtype), and whether ``v`` had
    any NaN or inf. Two read-only reductions; the masked recomputation runs only when
    needed. For whole tensors (blocks use :func:`_block_amax`)."""
    amax = torch.maximum(v.amax(dims, keepdim=keepdim), v.amin(dims, keepdim=keepdim).neg_())
    work = work_dtype(v.dtype)
    if math.isfinite(amax.max()):  # max propagates NaN
        return amax if amax.dtype == work else amax.to(work), False
    a = v.abs()
    a.masked_fill_(~torch.isfinite(a), 0)
    return a.amax(dims, keepdim=keepdim).to(work), True


def _block_amax(v4: torch.Tensor, scratch: torch.Tensor):
    """Per-block largest finite magnitude of the blocked work tensor ``v4`` (shape
    ``(groups, group_rows, blocks, block_cols)``), and whether it held NaN or inf.

    ``|v|`` goes into ``scratch`` by clearing sign bits, then one reduction (max-pooling
    for blocks of 16 or fewer, where torch's inner-dimension reduction is slow)."""
    a = torch.bitwise_and(v4.view(scratch.dtype), _ABS_MASK[scratch.dtype], out=scratch)
    a = a.view(v4.dtype)
    amax = _reduce_blocks(a)
    if math.isfinite(amax.max()):  # max propagates NaN
        return amax, False
    a.masked_fill_(~torch.isfinite(a), 0)
    return _reduce_blocks(a), True


def _reduce_blocks(a: torch.Tensor) -> torch.Tensor:
    groups, group_rows, blocks, block_cols = a.shape
    if group_rows == 1 and block_cols <= 16:
        pooled = torch.nn.functional.max_pool1d(a.view(groups, 1, -1), block_cols)
        return pooled.view(groups, 1, blocks, 1)
    return a.amax((1, 3), keepdim=True) if group_rows > 1 else a.amax(3, keepdim=True)


_ABS_MASK = {torch.int32: 0x7FFFFFFF, torch.int64: 0x7FFFFFFFFFFFFFFF}


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
