"""Triton kernels of GaussWS, bit-identical to the torch path of :mod:`.noise` /
:mod:`.sampling` (the paper's §3.6 split: generating R and adding it are separate kernels,
and the GEMM stays torch's):

* :func:`packed_noise` — one Philox4x32-10 block (``tl.randint4x``, the same generator as
  :func:`.noise.philox4x32`) per packed word, then eq. 7-8's AND/OR construction of 8 R codes:
  int32 words, 0.5 byte per element;
* :func:`perturb` — unpack each element's nibble and write ŵ = w + R · s, s read from the
  full tile grid at (row // block, col // block). Float32 arithmetic; R · s is exact, so the
  single rounding of the add (and the final rounding to bfloat16 / float16) matches torch's.

Used on CUDA automatically; tests run them on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import ShardLayout
from .noise import PHILOX_ROUNDS, words_per_row

__all__ = ["packed_noise", "perturb"]


@triton.jit
def _encode(a, b, c, d):
    """Eq. 7-8 on uint32 words (same expression as noise.encode)."""
    t = a | (a >> 1)
    e1 = t & (t >> 2) & b
    cc = c & (c >> 1)
    e2 = ((b >> 2) | (b >> 3)) & cc & (cc >> 2) & d & (d >> 1) & (d >> 2) & ~b
    sign = (b >> 1) & (e1 | e2)
    nib0 = 0x11111111
    return (e1 & nib0) | ((e2 & nib0) << 1) | ((sign & nib0) << 3)


@triton.jit
def _packed_noise_kernel(
    out_ptr, rows_ptr, n_rows, n_words, word_start, full_words, key,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, ROUNDS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    q = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (r[:, None] < n_rows) & (q[None, :] < n_words)
    g_row = tl.load(rows_ptr + r, mask=r < n_rows, other=0).to(tl.int64)
    counter = g_row[:, None] * full_words + (word_start + q[None, :]).to(tl.int64)
    a, b, c, d = tl.randint4x(key, counter, ROUNDS)
    codes = _encode(a, b, c, d).to(tl.int32, bitcast=True)
    tl.store(out_ptr + r[:, None].to(tl.int64) * n_words + q[None, :], codes, mask=mask)


def packed_noise(rows: torch.Tensor, word_start: int, n_words: int, full_cols: int, key: int):
    """Same contract as :func:`.noise.packed_noise`."""
    out = torch.empty(len(rows), n_words, dtype=torch.int32, device=rows.device)
    block_r, block_w = 32, 32
    grid = (triton.cdiv(len(rows), block_r), triton.cdiv(n_words, block_w))
    _packed_noise_kernel[grid](
        out, rows.contiguous(), len(rows), n_words, word_start, words_per_row(full_cols), key,
        BLOCK_R=block_r, BLOCK_W=block_w, ROUNDS=PHILOX_ROUNDS,
    )  # fmt: skip
    return out


@triton.jit
def _perturb_kernel(
    w_ptr, packed_ptr, rows_ptr, scale_ptr, out_ptr, n_rows, n_cols, n_words, col_start,
    grid_cols, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BF16: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < n_rows) & (c[None, :] < n_cols)
    g_row = tl.load(rows_ptr + r, mask=r < n_rows, other=0)
    g_col = col_start + c
    word = g_col // 8 - col_start // 8
    rows64 = r[:, None].to(tl.int64)
    packed = tl.load(packed_ptr + rows64 * n_words + word[None, :], mask=mask, other=0)
    code = (packed >> (4 * (g_col % 8))[None, :]) & 0xF
    value = ((code & 3) * (1 - 2 * ((code >> 3) & 1))).to(tl.float32)
    tile = (g_row // BLOCK)[:, None] * grid_cols + (g_col // BLOCK)[None, :]
    scale = tl.load(scale_ptr + tile, mask=mask, other=0.0)
    offs = rows64 * n_cols + c[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0)
    if BF16:  # bfloat16 <-> float32 by bits (the interpreter's casts drop subnormals)
        w = (w.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    y = w.to(tl.float32) + value * scale
    if BF16:  # round to nearest-even on the bits; NaN -> 0x7FC0 (torch's NaN)
        bits = y.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        y = tl.where(y == y, rounded, 0x7FC0).to(tl.int16)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def perturb(w: torch.Tensor, scale: torch.Tensor, layout: ShardLayout, packed: torch.Tensor):
    """Same contract as :func:`.sampling.perturb` (float32 ``scale`` grid; ``w`` float32,
    bfloat16 or float16)."""
    w = w.contiguous()
    bf16 = w.dtype == torch.bfloat16
    rows = layout.global_rows(w.device)
    c0 = layout.col_range[0]
    n_words = packed.shape[1]
    out = torch.empty_like(w)
    block_r, block_c = 32, 64
    grid = (triton.cdiv(w.shape[0], block_r), triton.cdiv(w.shape[1], block_c))
    _perturb_kernel[grid](
        w.view(torch.int16) if bf16 else w, packed.contiguous(), rows, scale.contiguous(),
        out.view(torch.int16) if bf16 else out, w.shape[0], w.shape[1], n_words, c0,
        scale.shape[1], BLOCK=layout.block, BLOCK_R=block_r, BLOCK_C=block_c, BF16=bf16,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
