"""Triton kernels for every scaled format: nearest-even and stochastic rounding, float32 /
bfloat16 / float16 inputs, bit for bit the torch reference for nearest-even.

Two launch plans:

* **fused** (tile ``1xN``, MX, NVFP4 block scales, and per row up to ``ROW_FUSED_MAX``
  columns): one pass per element (load, block amax, scale, round, dequantize, store), a
  program holding whole 1-row blocks — one read and one write, ``clone()``'s traffic;
* **two-pass** (per tensor, longer rows, ``NxN`` blocks): an amax kernel reduces each program's
  tile and ``atomic_max``-es it into its scale block's amax (int32 bits of a non-negative
  float32 order as the floats do), then the apply kernel reads each row's amax and quantizes.
  NVFP4's tensor amax also comes from the amax kernel (no host synchronisation).

Same numerics as the torch reference: every division is ``div_rn`` (Triton's ``/`` is
approximate on NVIDIA), floating-point contraction is off, scales are built from bits.
Stochastic rounding draws Philox-4x32 numbers with a seed taken from the ``torch.Generator``
(one draw per call): element ``(r, c)`` takes word ``c % 4`` of the output at counter
``r · ceil(cols / 4) + c // 4`` (the flat index's quarter and remainder when ``cols`` is a
multiple of 4), so one Philox evaluation serves four values and the draws are reproducible
per seed and independent of the tiling. It
is a different stream from the CPU reference: the two agree in distribution, not draw for
draw.

``fake_quant`` routes CUDA tensors here automatically (see :func:`supports`); the tests
run these kernels on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .elements import FloatElement, IntElement
from .grid import cdiv, next_power_of_2
from .registry import Format
from .scaling import AmaxScaling, MXScaling, NVScaling

__all__ = ["fake_quant_2d", "supports", "tensor_amax"]

_AMAX, _MX, _NV = 0, 1, 2


def supports(fmt: Format, x: torch.Tensor) -> bool:
    """Whether a kernel handles ``fmt`` on ``x`` (else the torch reference runs): amax
    scaling per tensor, per row, in power-of-two ``1xN`` tiles (N <= 256) or ``NxN`` blocks;
    MX and NVFP4 in power-of-two 1-row blocks (N <= 256)."""
    s, e = fmt.scaling, fmt.element
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if not isinstance(e, (FloatElement, IntElement)):
        return False
    if isinstance(s, AmaxScaling) and s.cols is None:
        return True  # per tensor or per row: the two-pass plan
    if not isinstance(s, (AmaxScaling, MXScaling, NVScaling)) or s.cols & (s.cols - 1):
        return False
    if s.rows == 1:
        return s.cols <= 256
    return isinstance(s, AmaxScaling) and s.rows == s.cols


@triton.jit
def _pow2(k):
    """Exact 2**k for an int32 tensor k in [-127, 127]."""
    normal = ((k + 127) << 23).to(tl.float32, bitcast=True)
    sub = tl.full(k.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(k == -127, sub, normal)


@triton.jit
def _round_grid(
    v,
    noise,
    ELEM_MAX: tl.constexpr,
    ELEM_EMIN: tl.constexpr,
    ELEM_MBITS: tl.constexpr,
    IS_INT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Saturate v to +-ELEM_MAX and round to the element grid (see rounding.py)."""
    v = tl.minimum(tl.maximum(v, -ELEM_MAX), ELEM_MAX)
    if IS_INT:
        binade = tl.full(v.shape, 1.0, tl.float32)
    else:
        bits = tl.maximum(v.to(tl.int32, bitcast=True) & 0x7F800000, (ELEM_EMIN + 127) << 23)
        binade = bits.to(tl.float32, bitcast=True)
    step = binade * (2.0**-ELEM_MBITS)
    if STOCHASTIC:
        q = tl.math.floor(tl.math.div_rn(v, step) + noise) * step
    else:
        magic = step * 12582912.0  # 1.5 * 2**23 * step
        q = (v + magic) - magic
    return q


@triton.jit
def _factors(
    amax,
    tensor_amax,
    SCALING: tl.constexpr,
    ELEM_MAX: tl.constexpr,
    ELEM_EMAX: tl.constexpr,
    DROP_BITS: tl.constexpr,
):
    """Per-block (quant, dequant) factors from the finite amax (see scaling.py)."""
    tiny = tl.full(amax.shape, 0x00800000, tl.int32).to(tl.float32, bitcast=True)
    one = tl.full(amax.shape, 1.0, tl.float32)
    if SCALING == 0:  # float32 d = amax / max, low significand bits cleared
        d = tl.math.div_rn(amax, one * ELEM_MAX)
        if DROP_BITS > 0:
            d = (d.to(tl.int32, bitcast=True) & ~((1 << DROP_BITS) - 1)).to(
                tl.float32, bitcast=True
            )
        d = tl.maximum(d, tiny)
        quant = tl.math.div_rn(one, d)
        dequant = d
    elif SCALING == 1:  # OCP MX: E8M0 2**s, s = floor(log2 amax) - emax
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        s = tl.minimum(tl.maximum(e - ELEM_EMAX, -127), 127)
        s = tl.where(amax == 0, -127, s)
        quant = _pow2(-s)
        dequant = _pow2(s)
    else:  # NVFP4: float32 tensor scale t, E4M3 block scale b
        t = tl.math.div_rn(one * tensor_amax, one * (448.0 * ELEM_MAX))
        t = tl.maximum(t, tiny * 64.0)
        b = tl.math.div_rn(tl.math.div_rn(amax, one * ELEM_MAX), t)
        b = tl.minimum(tl.maximum(b, 0.015625), 448.0)
        b = _round_grid(b, b, 448.0, -6, 3, False, False)
        quant = tl.math.div_rn(tl.math.div_rn(one, t), b)
        dequant = t * b
    return quant, dequant


@triton.jit
def _uniform_noise(
    seed, rows, col0, n_cols, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    NOISE_BITS: tl.constexpr,
):  # fmt: skip
    """``NOISE_BITS``-bit uniform draws in [0, 1) for the ``BLOCK_M x BLOCK_K`` tile of rows
    ``rows`` and columns from ``col0`` (module docstring): one Philox call per four columns
    when ``BLOCK_K`` is a multiple of 4 (``col0`` then is too), else per column."""
    if BLOCK_K % 4 == 0:
        quads = col0 // 4 + tl.arange(0, BLOCK_K // 4)
        counter = rows[:, None].to(tl.int64) * tl.cdiv(n_cols, 4) + quads[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        # join adds a minor dimension: [.., j, i] = (r0, r2)[j] if i == 0 else (r1, r3)[j]
        draws = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_M, BLOCK_K))
    else:
        cols = col0 + tl.arange(0, BLOCK_K)
        counter = rows[:, None].to(tl.int64) * tl.cdiv(n_cols, 4) + (cols // 4)[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        lane = (cols % 4)[None, :]
        draws = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    return (draws >> (32 - NOISE_BITS)).to(tl.float32) * (2.0**-NOISE_BITS)


@triton.jit
def _quantized(
    x, finite, quant, dequant, noise,
    ELEM_MAX: tl.constexpr, ELEM_EMIN: tl.constexpr, ELEM_MBITS: tl.constexpr,
    IS_INT: tl.constexpr, STOCHASTIC: tl.constexpr, OUT_BF16: tl.constexpr,
):  # fmt: skip
    """``round(x * quant) * dequant`` with x's sign (float32, bfloat16-exact when OUT_BF16);
    NaN and inf unchanged. ``noise``: the uniform draws of stochastic rounding (unused
    otherwise)."""
    q = _round_grid(
        tl.where(finite, x, 0.0) * quant, noise, ELEM_MAX, ELEM_EMIN, ELEM_MBITS, IS_INT, STOCHASTIC
    )
    y = q * dequant
    y_bits = (y.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | (
        x.to(tl.int32, bitcast=True) & -2147483648
    )
    if OUT_BF16:  # round to bfloat16 by hand (nearest-even), so the cast below is exact
        y_bits = (y_bits + 0x7FFF + ((y_bits >> 16) & 1)) & -65536
    return tl.where(finite, y_bits.to(tl.float32, bitcast=True), x)


@triton.jit
def _fused_kernel(
    x_ptr, y_ptr, n_rows, n_cols, tensor_amax_ptr, seed,
    BLOCK_M: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALING: tl.constexpr, ELEM_MAX: tl.constexpr, ELEM_EMAX: tl.constexpr, ELEM_EMIN: tl.constexpr,
    ELEM_MBITS: tl.constexpr, IS_INT: tl.constexpr, DROP_BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr, NOISE_BITS: tl.constexpr, OUT_BF16: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M rows x NUM_BLOCKS scale blocks of 1 x BLOCK_K."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * (NUM_BLOCKS * BLOCK_K) + tl.arange(0, NUM_BLOCKS * BLOCK_K)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    shape3: tl.constexpr = (BLOCK_M, NUM_BLOCKS, BLOCK_K)
    x = tl.reshape(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), shape3)
    finite = tl.abs(x) < float("inf")
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=2, keep_dims=True)
    tensor_amax = tl.load(tensor_amax_ptr)
    quant, dequant = _factors(amax, tensor_amax, SCALING, ELEM_MAX, ELEM_EMAX, DROP_BITS)
    noise = x
    if STOCHASTIC:
        noise = tl.reshape(_uniform_noise(seed, rows, tl.program_id(1) * (NUM_BLOCKS * BLOCK_K),
                                          n_cols, BLOCK_M, NUM_BLOCKS * BLOCK_K, NOISE_BITS),
                           shape3)
    y = _quantized(x, finite, quant, dequant, noise, ELEM_MAX, ELEM_EMIN, ELEM_MBITS, IS_INT,
                   STOCHASTIC, OUT_BF16)
    y = tl.reshape(y, (BLOCK_M, NUM_BLOCKS * BLOCK_K))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _amax_kernel(
    x_ptr, amax_ptr, n_rows, n_cols, scale_rows, scale_cols, n_scale_cols,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PER_ROW: tl.constexpr,
):  # fmt: skip
    """``atomic_max`` of the tile's largest finite magnitude (as int32 bits) into the amax of
    its ``scale_rows x scale_cols`` scale block (the tile lies inside one), or of each row's
    into that row's (PER_ROW: blocks one row high)."""
    row0 = tl.program_id(0) * BLOCK_M
    col0 = tl.program_id(1) * BLOCK_K
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    a = tl.abs(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    bits = tl.where(a < float("inf"), a, 0.0).to(tl.int32, bitcast=True)
    col_block = col0 // scale_cols
    if PER_ROW:
        index = rows.to(tl.int64) * n_scale_cols + col_block
        tl.atomic_max(amax_ptr + index, tl.max(bits, axis=1), mask=rows < n_rows)
    else:
        index = (row0 // scale_rows).to(tl.int64) * n_scale_cols + col_block
        tl.atomic_max(amax_ptr + index, tl.max(tl.max(bits, axis=1), axis=0))


@triton.jit
def _apply_kernel(
    x_ptr, y_ptr, amax_ptr, n_rows, n_cols, scale_rows, scale_cols, n_scale_cols, seed,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ELEM_MAX: tl.constexpr, ELEM_EMAX: tl.constexpr, ELEM_EMIN: tl.constexpr,
    ELEM_MBITS: tl.constexpr, IS_INT: tl.constexpr, DROP_BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr, NOISE_BITS: tl.constexpr, OUT_BF16: tl.constexpr,
):  # fmt: skip
    """Quantize a BLOCK_M x BLOCK_K tile (inside one scale block's columns) with the amax
    scaling of each row's block, read from the amax kernel's output."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_K
    cols = col0 + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    index = (rows // scale_rows).to(tl.int64) * n_scale_cols + col0 // scale_cols
    amax_bits = tl.load(amax_ptr + index, mask=rows < n_rows, other=0)
    amax = amax_bits.to(tl.float32, bitcast=True)[:, None]
    quant, dequant = _factors(amax, amax, 0, ELEM_MAX, ELEM_EMAX, DROP_BITS)
    noise = x
    if STOCHASTIC:
        noise = _uniform_noise(seed, rows, col0, n_cols, BLOCK_M, BLOCK_K, NOISE_BITS)
    y = _quantized(x, tl.abs(x) < float("inf"), quant, dequant, noise, ELEM_MAX, ELEM_EMIN,
                   ELEM_MBITS, IS_INT, STOCHASTIC, OUT_BF16)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


TILE_ELEMS = 8192
"""Values per program of the amax and apply kernels (a power of two)."""


def _tile(rows: int, cols: int, scale_rows: int, scale_cols: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of the two-pass kernels: about ``TILE_ELEMS`` values, as wide as
    ``cols`` allows (up to 1024), inside one scale block of ``scale_rows x scale_cols``
    (powers of two where smaller than the tensor)."""
    block_k = min(1024, next_power_of_2(cols))
    if scale_cols < cols:
        block_k = min(block_k, scale_cols)
    block_m = min(TILE_ELEMS // block_k, next_power_of_2(rows))
    if scale_rows < rows:
        block_m = min(block_m, scale_rows)
    return block_m, block_k


def block_amax(x: torch.Tensor, scale_rows: int, scale_cols: int) -> torch.Tensor:
    """The largest finite magnitude of each ``scale_rows x scale_cols`` block of the
    contiguous 2-D ``x``, as float32 ``(ceil(rows / scale_rows), ceil(cols / scale_cols))``
    (power-of-two block sides, or the whole dimension)."""
    rows, cols = x.shape
    amax = torch.zeros(cdiv(rows, scale_rows), cdiv(cols, scale_cols),
                       dtype=torch.int32, device=x.device)  # fmt: skip
    block_m, block_k = _tile(rows, cols, scale_rows, scale_cols)
    grid = (cdiv(rows, block_m), cdiv(cols, block_k))
    _amax_kernel[grid](
        x, amax, rows, cols, scale_rows, scale_cols, amax.shape[1],
        BLOCK_M=block_m, BLOCK_K=block_k, PER_ROW=scale_rows == 1, num_warps=8,
    )  # fmt: skip
    return amax.view(torch.float32)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude of the contiguous 2-D ``x``: float32, shape ``(1,)``."""
    return block_amax(x, x.shape[0], x.shape[1]).reshape(1)


def _seed(fmt: Format, generator: torch.Generator | None) -> tuple[int, int]:
    """(seed, noise bits) of one call: one draw from ``generator`` for ``+sr``."""
    if not fmt.stochastic:
        return 0, 1
    gen_device = generator.device if generator is not None else torch.device("cpu")
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=gen_device))
    return seed, 24 - fmt.element.noise_int_bits


def _element_args(fmt: Format, x: torch.Tensor, generator) -> dict:
    """The constexpr arguments both apply kernels share (and the seed)."""
    e = fmt.element
    is_float = isinstance(e, FloatElement)
    seed, noise_bits = _seed(fmt, generator)
    return dict(
        seed=seed, ELEM_MAX=float(e.max), ELEM_EMAX=e.emax, ELEM_EMIN=e.emin if is_float else 0,
        ELEM_MBITS=e.mbits if is_float else 0, IS_INT=not is_float,
        DROP_BITS=e.max_significand_bits if isinstance(fmt.scaling, AmaxScaling) else 0,
        STOCHASTIC=fmt.stochastic, NOISE_BITS=noise_bits, OUT_BF16=x.dtype == torch.bfloat16,
        enable_fp_fusion=False,
    )  # fmt: skip


def fake_quant_2d(
    x: torch.Tensor, fmt: Format, generator: torch.Generator | None = None,
    tensor_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize-dequantize a contiguous 2-D tensor (blocks along dim 1) with the kernels
    (``tensor_amax``: the whole tensor's when ``x`` is a shard, as in ``fake_quant``)."""
    s = fmt.scaling
    if isinstance(s, AmaxScaling) and s.rows == 1 and s.cols is None:  # per row
        block_k = next_power_of_2(x.shape[1])
        if block_k <= ROW_FUSED_MAX // (2 if fmt.stochastic else 1):  # a row per program
            return _fused(x, fmt, generator, tensor_amax, block_k)
    if isinstance(s, AmaxScaling) and (s.rows != 1 or s.cols is None):
        return _two_pass(x, fmt, generator, tensor_amax)
    return _fused(x, fmt, generator, tensor_amax, s.cols)


ROW_FUSED_MAX = 16384
"""Longest row (padded to a power of two) that per-row scaling quantizes in one pass, a row
per program, half that with stochastic rounding (its draws take registers: a longer row
would spill on sm_90); longer rows take the two-pass plan."""


@functools.cache
def _unused_amax(device: torch.device) -> torch.Tensor:
    """The tensor amax the fused kernel loads but only NVFP4 uses: one zero per device, not a
    fill kernel per call."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def _fused(x, fmt, generator, amax, block_k: int) -> torch.Tensor:
    """The fused kernel over 1 x ``block_k`` scale blocks: up to 32 rows of 128 values or
    more, 8192 values at most unless one block is longer (a long row: one per program); 32
    values a thread, 16 with stochastic rounding (no register spills on sm_90)."""
    rows, cols = x.shape
    if not fmt.scaling.needs_tensor_amax:
        amax = _unused_amax(x.device)
    elif amax is None:
        amax = tensor_amax(x)
    else:
        amax = amax.reshape(1).float()
    num_blocks = max(1, 128 // block_k)
    block_m = max(1, min(32, 8192 // (num_blocks * block_k)))
    elems = block_m * num_blocks * block_k
    grid = (cdiv(rows, block_m), cdiv(cols, num_blocks * block_k))
    y = torch.empty_like(x)
    _fused_kernel[grid](
        x, y, rows, cols, amax, BLOCK_M=block_m, NUM_BLOCKS=num_blocks, BLOCK_K=block_k,
        SCALING={AmaxScaling: _AMAX, MXScaling: _MX, NVScaling: _NV}[type(fmt.scaling)],
        num_warps=min(16, max(4, elems // (512 if fmt.stochastic else 1024))),
        **_element_args(fmt, x, generator),
    )  # fmt: skip
    return y


def _two_pass(x, fmt, generator, amax) -> torch.Tensor:
    shape = x.shape
    if fmt.scaling.rows is None and x.numel() % 1024 == 0:  # one scale: any layout will do
        x = x.view(-1, 1024)
    rows, cols = x.shape
    scale_rows, scale_cols = fmt.scaling.rows or rows, fmt.scaling.cols or cols
    if amax is not None and fmt.scaling.rows is None:  # a shard scaled as the whole tensor
        amax = amax.reshape(1, 1).float()
    else:
        amax = block_amax(x, scale_rows, scale_cols)
    block_m, block_k = _tile(rows, cols, scale_rows, scale_cols)
    grid = (cdiv(rows, block_m), cdiv(cols, block_k))
    y = torch.empty_like(x)
    _apply_kernel[grid](
        x, y, amax.view(torch.int32), rows, cols, scale_rows, scale_cols, amax.shape[1],
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=8, **_element_args(fmt, x, generator),
    )  # fmt: skip
    return y.view(shape)
