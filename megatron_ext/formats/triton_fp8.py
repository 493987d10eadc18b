"""Triton kernels that write one operand in FP8 (see :mod:`.fp8`).

:func:`quantize_blocks` does everything in one pass for 1x128 tiles, 128x128 blocks and rows
of up to ``fp8.ROW_MAX`` values (per-row scales of a row-major operand): a program loads whole
scale blocks, takes their finite amax, makes the factors with the
reference's rules (``_factors`` of :mod:`.triton_kernels`, as ``fake_quant``'s kernel does),
rounds, and writes the FP8 values and the float32 block scales.

:func:`scale_and_cast` is the second pass for per-tensor and per-row scales, whose amax a
reduction has taken first (the factors are made in the kernel, as above): each program loads
a ``BLOCK x BLOCK`` tile of the input through its strides (a transposed view reads in
place), multiplies by the quantization factor of each value's scale block, rounds onto the
element grid with the reference's nearest-even rule (``_round_grid`` of
:mod:`.triton_kernels`, saturating), keeps the input's sign on zeros, and stores the values
(exact in FP8 by then, so the cast cannot round again) row-major, and on request transposed
as well: a per-tensor operand that two GEMMs read along different axes gets both layouts
from one pass. Bit-identical to the torch path of :func:`.fp8.to_fp8` (tested under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grid import cdiv
from .triton_kernels import TILE_ELEMS, _factors, _round_grid

__all__ = ["quantize_blocks", "scale_and_cast"]

_BLOCK = 64


@triton.jit
def _scale_cast_kernel(
    x_ptr, amax_ptr, out_ptr, out_t_ptr, scale_ptr, n_rows, n_cols, sx_r, sx_c, scale_rows,
    scale_cols, n_scale_cols, BLOCK: tl.constexpr, WHOLE_ROWS: tl.constexpr,
    WRITE_T: tl.constexpr, ELEM_MAX: tl.constexpr,
    ELEM_EMAX: tl.constexpr, ELEM_EMIN: tl.constexpr, ELEM_MBITS: tl.constexpr,
    DROP_BITS: tl.constexpr,
):  # fmt: skip
    """One BLOCK x BLOCK tile: factors of each value's scale block from its amax, round, cast;
    the first value of each scale block writes the block's ``d``. WHOLE_ROWS (per-tensor and
    per-row scales: a block spans every column): one amax and its factors per row. WRITE_T:
    the values are also stored transposed, ``(cols, rows)`` row-major, at ``out_t_ptr``."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    r64, c64 = rows.to(tl.int64), cols.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * sx_r + c64[None, :] * sx_c, mask=mask, other=0.0)
    if WHOLE_ROWS:
        index = (r64 // scale_rows)[:, None]
        amax = tl.load(amax_ptr + index, mask=rows[:, None] < n_rows, other=1.0)
    else:
        index = (r64 // scale_rows)[:, None] * n_scale_cols + (c64 // scale_cols)[None, :]
        amax = tl.load(amax_ptr + index, mask=mask, other=1.0)
    quant, dequant = _factors(amax.to(tl.float32), amax.to(tl.float32), 0, ELEM_MAX, ELEM_EMAX,
                              DROP_BITS)
    x = x.to(tl.float32)
    v = _round_grid(x * quant, x, ELEM_MAX, ELEM_EMIN, ELEM_MBITS, False, False)
    sign = x.to(tl.int32, bitcast=True) & -2147483648  # a value rounded to 0 keeps its sign
    v = ((v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | sign).to(tl.float32, bitcast=True)
    v = v.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r64[:, None] * n_cols + c64[None, :], v, mask=mask)
    if WRITE_T:
        tl.store(out_t_ptr + c64[None, :] * n_rows + r64[:, None], v, mask=mask)
    if WHOLE_ROWS:  # each column tile writes its rows' d (the same value)
        first = ((rows < n_rows) & (r64 % scale_rows == 0))[:, None]
    else:
        first = mask & (r64 % scale_rows == 0)[:, None] & (c64 % scale_cols == 0)[None, :]
    tl.store(scale_ptr + index, dequant, mask=first)


def element_args(element) -> dict:
    """The FP8 element's constexprs both kernels take (its grid and the amax rule's)."""
    return dict(ELEM_MAX=float(element.max), ELEM_EMAX=element.emax, ELEM_EMIN=element.emin,
                ELEM_MBITS=element.mbits, DROP_BITS=element.max_significand_bits)


def scale_and_cast(t: torch.Tensor, amax: torch.Tensor, block_rows: int, block_cols: int,
                   element, dtype: torch.dtype, with_transpose: bool = False):
    """``(data, d)``: ``round(t * (1/d))`` as ``dtype`` ``(rows, cols)`` and float32 ``d`` per
    ``block_rows x block_cols`` block, ``d`` made from ``amax`` (one value per block, any
    float dtype) by the amax-scaling rule; ``t`` 2-D, any strides. ``with_transpose``:
    ``(data, d, data_t)``, the same values also written ``(cols, rows)`` row-major by the
    same pass (one scale per tensor: the operand of the GEMM that reduces along the other
    axis)."""
    rows, cols = t.shape
    out = torch.empty(rows, cols, dtype=dtype, device=t.device)
    out_t = torch.empty(cols, rows, dtype=dtype, device=t.device) if with_transpose else out
    amax = amax.contiguous()
    scale = torch.empty(amax.shape, dtype=torch.float32, device=t.device)
    whole_rows = block_cols == cols
    # 8 values a thread (64 registers on sm_90 for whole rows); per-value factors at 64 x 64
    # and 4 warps would spill
    block, warps = (_BLOCK, 16) if whole_rows else (_BLOCK // 2, 4)
    grid = (cdiv(rows, block), cdiv(cols, block))
    _scale_cast_kernel[grid](
        t, amax, out, out_t, scale, rows, cols, t.stride(0), t.stride(1), block_rows,
        block_cols, amax.shape[1], BLOCK=block, WHOLE_ROWS=whole_rows, WRITE_T=with_transpose,
        **element_args(element), num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return (out, scale, out_t) if with_transpose else (out, scale)


@triton.jit
def _quantize_blocks_kernel(
    x_ptr, out_ptr, scale_ptr, n_rows, n_cols, sx_r, sx_c, n_scale_cols,
    BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ELEM_MAX: tl.constexpr, ELEM_EMAX: tl.constexpr, ELEM_EMIN: tl.constexpr,
    ELEM_MBITS: tl.constexpr, DROP_BITS: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M rows x one BLOCK_K-wide column block; a scale block is
    GROUP_M x BLOCK_K (GROUP_M 1 for tiles, BLOCK_M for square blocks)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    r64, c64 = rows.to(tl.int64), cols.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * sx_r + c64[None, :] * sx_c, mask=mask, other=0.0)
    shape3: tl.constexpr = (BLOCK_M // GROUP_M, GROUP_M, BLOCK_K)
    x = tl.reshape(x.to(tl.float32), shape3)
    finite = tl.abs(x) < float("inf")
    amax = tl.max(tl.max(tl.where(finite, tl.abs(x), 0.0), axis=2, keep_dims=True), axis=1,
                  keep_dims=True)
    quant, dequant = _factors(amax, amax, 0, ELEM_MAX, ELEM_EMAX, DROP_BITS)
    q = _round_grid(tl.where(finite, x, 0.0) * quant, x, ELEM_MAX, ELEM_EMIN, ELEM_MBITS,
                    False, False)
    sign = x.to(tl.int32, bitcast=True) & -2147483648  # a value rounded to 0 keeps its sign
    q = ((q.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | sign).to(tl.float32, bitcast=True)
    q = tl.reshape(tl.where(finite, q, x), (BLOCK_M, BLOCK_K))
    tl.store(out_ptr + r64[:, None] * n_cols + c64[None, :], q.to(out_ptr.dtype.element_ty),
             mask=mask)
    groups = tl.program_id(0) * (BLOCK_M // GROUP_M) + tl.arange(0, BLOCK_M // GROUP_M)
    d = tl.reshape(dequant, (BLOCK_M // GROUP_M,))
    tl.store(scale_ptr + groups.to(tl.int64) * n_scale_cols + tl.program_id(1), d,
             mask=groups < n_rows // GROUP_M)


def quantize_blocks(t: torch.Tensor, fmt, dtype: torch.dtype):
    """``(data, scale)`` of ``t`` (2-D, any strides) in ``fmt``'s 1xN tiles or NxN blocks
    (N a power of two <= 128 that divides the shape), or per row (rows of at most
    ``TILE_ELEMS`` values, read row-major), one pass."""
    rows, cols = t.shape
    s, e = fmt.scaling, fmt.element
    group_m = s.rows
    block_k = s.cols or triton.next_power_of_2(cols)  # a whole row, its tail masked
    block_m = group_m if group_m > 1 else min(32, max(1, TILE_ELEMS // block_k))
    out = torch.empty(rows, cols, dtype=dtype, device=t.device)
    scale = torch.empty(rows // group_m, cdiv(cols, block_k), dtype=torch.float32,
                        device=t.device)  # fmt: skip
    grid = (cdiv(rows, block_m), scale.shape[1])
    _quantize_blocks_kernel[grid](
        t, out, scale, rows, cols, t.stride(0), t.stride(1), scale.shape[1],
        BLOCK_M=block_m, GROUP_M=group_m, BLOCK_K=block_k, **element_args(e),
        num_warps=16 if s.cols is None else (8 if block_m * block_k >= 8192 else 4),
        enable_fp_fusion=False,  # rows: 16 values a thread, 63 registers on sm_90
    )  # fmt: skip
    return out, scale
