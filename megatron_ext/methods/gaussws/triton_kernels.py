"""Triton kernels of GaussWS, against the torch path of :mod:`.noise` / :mod:`.sampling`
(the GEMM stays torch's). Both make R in registers: per element, the 64-bit SplitMix64
output of its draw (the same counter and arithmetic as :func:`.noise.random_words`, in
uint64), its 16-bit lane, eq. 7-8's AND/OR construction (:func:`.noise.encode` on one nibble)
— where the torch path looks the 16 bits up in a table. R never goes to memory.

* :func:`perturb` — ŵ = w + R · s in one pass, s read from the full tile grid at
  (row // block, col // block). Float32 arithmetic; R · s is exact, so the single rounding
  of the add (and the final rounding to bfloat16 / float16) matches torch's: bit for bit;
* :func:`noise_dot` — eq. 3's sums per local row and tile column, Σ ∂L/∂ŵ ⊙ R: one read of
  the gradient (the torch path writes R, then the product, then sums). Each product is
  exact (R ∈ {-2..2}); the float32 sum of a tile's row runs in another order than torch's,
  so the sums agree to float32 rounding, not bit for bit (tested against float64).

Used on CUDA automatically; tests run them on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron_ext.formats.grid import cdiv, next_power_of_2

from .layout import ShardLayout
from .noise import GAMMA, as_int64, draws_per_row

__all__ = ["noise_dot", "perturb"]


@triton.jit
def _encode(a, b, c, d):
    """Eq. 7-8 on nibble words (same expression as noise.encode)."""
    t = a | (a >> 1)
    e1 = t & (t >> 2) & b
    cc = c & (c >> 1)
    e2 = ((b >> 2) | (b >> 3)) & cc & (cc >> 2) & d & (d >> 1) & (d >> 2) & ~b
    sign = (b >> 1) & (e1 | e2)
    return (e1 & 1) | ((e2 & 1) << 1) | ((sign & 1) << 3)


@triton.jit
def _r_value(g_row, g_col, full_draws, key_gamma):
    """R (float32) of full-tensor elements (g_row, g_col); ``key_gamma`` = key + γ (int64)."""
    n = g_row.to(tl.int64) * full_draws + (g_col // 4).to(tl.int64)
    z = key_gamma.to(tl.uint64, bitcast=True) + n.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    bits = ((z >> (16 * (g_col % 4)).to(tl.uint64)) & 0xFFFF).to(tl.int32)
    code = _encode(bits, bits >> 4, bits >> 8, bits >> 12)
    return ((code & 3) * (1 - 2 * ((code >> 3) & 1))).to(tl.float32)


@triton.jit
def _load_float32(ptr, mask, BF16: tl.constexpr):
    """Values at ``ptr`` as float32 (0 where masked); bfloat16 (read as int16) by its bits:
    the interpreter's casts drop subnormals."""
    v = tl.load(ptr, mask=mask, other=0)
    if BF16:
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _perturb_kernel(
    w_ptr, rows_ptr, scale_ptr, out_ptr, n_rows, n_cols, col_start, full_draws, key_gamma,
    grid_cols, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < n_rows) & (c[None, :] < n_cols)
    g_row = tl.load(rows_ptr + r, mask=r < n_rows, other=0)
    g_col = col_start + c
    value = _r_value(g_row[:, None], g_col[None, :], full_draws, key_gamma)
    tile = (g_row // BLOCK)[:, None] * grid_cols + (g_col // BLOCK)[None, :]
    scale = tl.load(scale_ptr + tile, mask=mask, other=0.0)
    offs = r[:, None].to(tl.int64) * n_cols + c[None, :]
    w = _load_float32(w_ptr + offs, mask, BF16)
    y = w + value * scale
    if BF16:  # round to nearest-even on the bits; NaN -> 0x7FC0 (torch's NaN)
        bits = y.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        y = tl.where(y == y, rounded, 0x7FC0).to(tl.int16)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def perturb(w: torch.Tensor, scale: torch.Tensor, layout: ShardLayout, key: int,
            rows: torch.Tensor | None = None):
    """Same contract as :func:`.sampling.perturb` (float32 ``scale`` grid; ``w`` float32,
    bfloat16 or float16; ``rows``: the layout's full row indices on ``w``'s device, made if
    not given)."""
    w = w.contiguous()
    bf16 = w.dtype == torch.bfloat16
    rows = layout.global_rows(w.device) if rows is None else rows
    out = torch.empty_like(w)
    block_r, block_c = 32, 64
    grid = (cdiv(w.shape[0], block_r), cdiv(w.shape[1], block_c))
    _perturb_kernel[grid](
        w.view(torch.int16) if bf16 else w, rows, scale.contiguous(),
        out.view(torch.int16) if bf16 else out, w.shape[0], w.shape[1], layout.col_range[0],
        draws_per_row(layout.full_shape[1]), as_int64(key + GAMMA), scale.shape[1],
        BLOCK=layout.block, BLOCK_R=block_r, BLOCK_C=block_c, BF16=bf16,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out


@triton.jit
def _noise_dot_kernel(grad_ptr, rows_ptr, out_ptr, n_rows, n_cols, n_tiles, col_start,
                      full_draws, key_gamma, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_R: tl.constexpr, BF16: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.arange(0, BLOCK_P)  # one tile's columns, padded to a power of two
    g_col = (col_start // BLOCK + tl.program_id(1)) * BLOCK + k
    c = g_col - col_start
    mask = (r[:, None] < n_rows) & ((k < BLOCK) & (c >= 0) & (c < n_cols))[None, :]
    g_row = tl.load(rows_ptr + r, mask=r < n_rows, other=0)
    value = _r_value(g_row[:, None], g_col[None, :], full_draws, key_gamma)
    grad = _load_float32(grad_ptr + r[:, None].to(tl.int64) * n_cols + c[None, :], mask, BF16)
    total = tl.sum(value * grad, axis=1)
    tl.store(out_ptr + r.to(tl.int64) * n_tiles + tl.program_id(1), total, mask=r < n_rows)


def noise_dot(grad: torch.Tensor, rows: torch.Tensor, layout: ShardLayout, key: int):
    """Eq. 3's column sums: ``(local rows, tile columns from col_range[0] // block)`` float32,
    Σ over each tile's columns of ``grad ⊙ R`` (``grad`` float32, bfloat16 or float16; ``rows``
    the layout's full row indices), as :func:`.layout.block_reduce` takes ``col_partial``."""
    grad = grad.contiguous()
    bf16 = grad.dtype == torch.bfloat16
    b, (c0, c1) = layout.block, layout.col_range
    n_tiles = -(-(c0 % b + c1 - c0) // b)
    out = torch.empty(grad.shape[0], n_tiles, dtype=torch.float32, device=grad.device)
    block_r = 32
    _noise_dot_kernel[(cdiv(grad.shape[0], block_r), n_tiles)](
        grad.view(torch.int16) if bf16 else grad, rows, out, grad.shape[0], grad.shape[1],
        n_tiles, c0, draws_per_row(layout.full_shape[1]), as_int64(key + GAMMA),
        BLOCK=b, BLOCK_P=next_power_of_2(b), BLOCK_R=block_r, BF16=bf16,
    )  # fmt: skip
    return out
