"""The Triton pass behind :func:`.error.error_sums`: each program reads ``BLOCK`` values of
``t`` and ``q`` and writes its three float64 partial sums; torch adds the partials (a fixed
order: the same sums for the same inputs, run after run)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid import cdiv

__all__ = ["error_sums_1d"]

BLOCK = 4096
"""Values per program."""


@triton.jit
def _error_sums_kernel(t_ptr, q_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    t = tl.load(t_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    d = t - q
    underflow = ((t != 0.0) & (q == 0.0)).to(tl.float64)  # masked lanes: t = 0
    out = partial_ptr + tl.program_id(0) * 3
    tl.store(out, tl.sum(underflow, axis=0))
    tl.store(out + 1, tl.sum(d * d, axis=0))
    tl.store(out + 2, tl.sum(t * t, axis=0))


def error_sums_1d(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[underflow, Σ (t − q)², Σ t²]`` of two contiguous 1-D float tensors, float64."""
    n = t.numel()
    programs = max(1, cdiv(n, BLOCK))
    partial = torch.empty(programs, 3, dtype=torch.float64, device=t.device)
    if n == 0:
        return partial.zero_().sum(0)
    _error_sums_kernel[(programs,)](t, q, partial, n, BLOCK=BLOCK, num_warps=8,
                                    enable_fp_fusion=False)
    return partial.sum(0)
