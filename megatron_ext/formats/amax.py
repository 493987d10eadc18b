"""Amaxes: the largest *finite* magnitude of a whole tensor or of each block.

Every scaling starts from an amax (:mod:`.scaling`). NaN and ±inf are left out of it, so a
block holding one is scaled by its finite values (and the special values pass through
unchanged). Both the torch reference (:mod:`.pipeline`) and the Triton kernels
(:mod:`.triton_kernels`) take the tensor amax from here.

The common case is cheap on CPU: one read-only reduction pass (or two, for a max and a min),
and the masked recomputation that drops NaN and inf runs only when the fast result is not
finite. Deciding that reads the result on the host, which on a GPU waits for every kernel
queued before it; so on CUDA (where the Triton kernels take most formats, and this path runs
for float64, a format they do not take, and ``precision.gemm.whole_tensor_amax`` under TP)
the masked reduction always runs, and the tensor is reported as possibly non-finite (its
special values then pass through by a ``where``, which leaves finite values unchanged).
"""

from __future__ import annotations

import math

import torch

from .rounding import work_dtype

__all__ = ["block_amax", "finite_amax", "reads_host"]


def reads_host(v: torch.Tensor) -> bool:
    """Whether the fast path may read ``v``'s amax on the host: not for CUDA tensors."""
    return not v.is_cuda


def finite_amax(v: torch.Tensor, dims: tuple[int, ...], keepdim: bool = True):
    """Largest finite magnitude of ``v`` over ``dims`` (work dtype), and whether ``v`` had
    any NaN or inf (True, unread, on CUDA). Two read-only reductions; the masked
    recomputation runs only when needed. For whole tensors (blocks use :func:`block_amax`)."""
    work = work_dtype(v.dtype)
    if reads_host(v):
        amax = torch.maximum(v.amax(dims, keepdim=keepdim), v.amin(dims, keepdim=keepdim).neg_())
        if math.isfinite(amax.max()):  # max propagates NaN
            return amax if amax.dtype == work else amax.to(work), False
    a = v.abs().nan_to_num_(nan=0.0, posinf=0.0)  # |v| with NaN and inf as 0: two passes
    return a.amax(dims, keepdim=keepdim).to(work), True


def block_amax(v4: torch.Tensor, scratch: torch.Tensor):
    """Per-block largest finite magnitude of the blocked work tensor ``v4`` (shape
    ``(groups, group_rows, blocks, block_cols)``), and whether it held NaN or inf (True,
    unread, on CUDA).

    ``|v|`` goes into ``scratch`` (an integer tensor of ``v4``'s shape and width) by
    clearing sign bits, then one reduction (max-pooling for blocks of 16 or fewer, where
    torch's inner-dimension reduction is slow)."""
    a = torch.bitwise_and(v4.view(scratch.dtype), _ABS_MASK[scratch.dtype], out=scratch)
    a = a.view(v4.dtype)
    if reads_host(v4):
        amax = _reduce_blocks(a)
        if math.isfinite(amax.max()):  # max propagates NaN
            return amax, False
    return _reduce_blocks(a.nan_to_num_(nan=0.0, posinf=0.0)), True


def _reduce_blocks(a: torch.Tensor) -> torch.Tensor:
    groups, group_rows, blocks, block_cols = a.shape
    if group_rows == 1 and block_cols <= 16:
        pooled = torch.nn.functional.max_pool1d(a.view(groups, 1, -1), block_cols)
        return pooled.view(groups, 1, blocks, 1)
    return a.amax((1, 3), keepdim=True) if group_rows > 1 else a.amax(3, keepdim=True)


_ABS_MASK = {torch.int32: 0x7FFFFFFF, torch.int64: 0x7FFFFFFFFFFFFFFF}
