"""Quantization error of a tensor ``t`` against its dequantized copy ``q = Q(t)``, as the
three float64 sums the methods judge a format by:

    underflow = #{ t != 0 and q == 0 }     (values flushed to zero)
    sq_err    = Σ (t − q)²                 (PGQ's noise, GNMR's MSE numerator)
    sq        = Σ t²                       (PGQ's signal, SQNR = sq / sq_err)

Each term is formed in float64 — ``t − q`` of two float32 / bfloat16 values is exact there
unless their exponents lie more than 29 apart, and its square is rounded once — and summed
in float64, so the sums hold every digit a float32 operand can carry.

On CUDA one Triton pass (:mod:`.triton_error`) reads ``t`` and ``q`` once: each program sums
its block, and torch adds the per-program partial sums. The torch reference (CPU, or
``MEGATRON_EXT_FORMATS_BACKEND=torch``) materialises the float64 copies, their difference
and squares — about 130 bytes of traffic per value against the kernel's 4 for BF16, which
is what a profile that measures every operand of every GEMM spends its time on. The two
agree term for term; only the order of the float64 additions differs (tested under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from .pipeline import triton_backend

__all__ = ["SUMS", "error_sums"]

SUMS = ("underflow", "sq_err", "sq")
"""The order of :func:`error_sums`' entries."""


def error_sums(t: torch.Tensor, q: torch.Tensor, underflow: bool = True) -> torch.Tensor:
    """``[underflow, Σ (t − q)², Σ t²]`` (module docstring) as float64 on ``t``'s device, for
    ``q`` of ``t``'s shape; no host synchronisation. ``underflow=False``: a caller that does
    not read the count spares the torch path its passes (the kernel counts for free)."""
    if t.shape != q.shape:
        raise ValueError(f"error_sums: t {tuple(t.shape)} and q {tuple(q.shape)} differ")
    if triton_backend(t) and t.is_floating_point() and t.dtype != torch.float64:
        from .triton_error import error_sums_1d

        return error_sums_1d(*_paired_flat(t, q))
    return reference_error_sums(t, q, underflow)


def reference_error_sums(t: torch.Tensor, q: torch.Tensor, underflow: bool = True
                         ) -> torch.Tensor:
    """:func:`error_sums` with torch ops in float64 (any device); the count is 0 without
    ``underflow``."""
    t64, q64 = t.double(), q.double()
    count = ((t != 0) & (q == 0)).sum() if underflow else torch.zeros((), device=t.device)
    return torch.stack([count.double(), (t64 - q64).square().sum(), t64.square().sum()])


def _paired_flat(t: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` and ``q`` as 1-D tensors whose i-th values belong together (the sums do not
    depend on the order): views where both are row-major or both transposed 2-D views,
    copies otherwise."""
    if t.ndim == 2 and not t.is_contiguous() and t.t().is_contiguous() and q.t().is_contiguous():
        t, q = t.t(), q.t()
    return t.contiguous().view(-1), q.contiguous().view(-1)
