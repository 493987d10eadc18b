"""Triton kernels for the hot formats: tile / block / MX / NVFP4 scaling, nearest-even and
stochastic rounding, one fused pass (load, block amax, scale, round, dequantize, store).

Same numerics as the torch reference, bit for bit for nearest-even: every division is
``div_rn`` (Triton's ``/`` is approximate on NVIDIA), floating-point contraction is off,
scales are built from bits. Stochastic rounding draws Philox numbers keyed by the
element's flat index and a seed taken from the ``torch.Generator`` (one draw per call),
so it is reproducible per seed and independent of the tiling, but it is a different
stream from the CPU reference: the two agree in distribution, not draw for draw.

``fake_quant`` routes CUDA tensors here automatically (see :func:`supports`); the tests
run these kernels on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .elements import FloatElement, IntElement
from .amax import finite_amax
from .registry import Format
from .scaling import AmaxScaling, MXScaling, NVScaling

__all__ = ["fake_quant_2d", "supports"]

_AMAX, _MX, _NV = 0, 1, 2


def supports(fmt: Format, x: torch.Tensor) -> bool:
    """Whether the kernel handles ``fmt`` on ``x`` (else the torch reference runs)."""
    s, e = fmt.scaling, fmt.element
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if not isinstance(e, (FloatElement, IntElement)) or s.cols is None:
        return False
    if not isinstance(s, (AmaxScaling, MXScaling, NVScaling)) or s.rows not in (1, s.cols):
        return False
    largest = 256 if s.rows == 1 else 128  # a square block is one program's tile
    return s.cols & (s.cols - 1) == 0 and s.cols <= largest


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
def _fake_quant_kernel(
    x_ptr, y_ptr, n_rows, n_cols, tensor_amax_ptr, seed,
    BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALING: tl.constexpr, ELEM_MAX: tl.constexpr, ELEM_EMAX: tl.constexpr, ELEM_EMIN: tl.constexpr,
    ELEM_MBITS: tl.constexpr, IS_INT: tl.constexpr, DROP_BITS: tl.constexpr,
    STOCHASTIC: tl.constexpr, NOISE_BITS: tl.constexpr, OUT_BF16: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M rows x NUM_BLOCKS scale blocks of BLOCK_K columns; a scale block
    is GROUP_M x BLOCK_K (GROUP_M is 1 for tiles, BLOCK_M for square blocks)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * (NUM_BLOCKS * BLOCK_K) + tl.arange(0, NUM_BLOCKS * BLOCK_K)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    shape4: tl.constexpr = (BLOCK_M // GROUP_M, GROUP_M, NUM_BLOCKS, BLOCK_K)
    x = tl.reshape(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), shape4)
    finite = tl.abs(x) < float("inf")
    a = tl.where(finite, tl.abs(x), 0.0)
    amax = tl.max(tl.max(a, axis=3, keep_dims=True), axis=1, keep_dims=True)
    tensor_amax = tl.load(tensor_amax_ptr)
    quant, dequant = _factors(amax, tensor_amax, SCALING, ELEM_MAX, ELEM_EMAX, DROP_BITS)
    noise = x
    if STOCHASTIC:
        draws = tl.randint(seed, tl.reshape(offs, shape4).to(tl.uint32))
        noise = (draws >> (32 - NOISE_BITS)).to(tl.float32) * (2.0**-NOISE_BITS)
    q = _round_grid(
        tl.where(finite, x, 0.0) * quant, noise, ELEM_MAX, ELEM_EMIN, ELEM_MBITS, IS_INT, STOCHASTIC
    )
    y = q * dequant
    y_bits = (y.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | (
        x.to(tl.int32, bitcast=True) & -2147483648
    )
    if OUT_BF16:  # round to bfloat16 by hand (nearest-even), so the cast below is exact
        y_bits = (y_bits + 0x7FFF + ((y_bits >> 16) & 1)) & -65536
    y = tl.where(finite, y_bits.to(tl.float32, bitcast=True), x)
    y = tl.reshape(y, (BLOCK_M, NUM_BLOCKS * BLOCK_K))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch_shape(fmt: Format) -> tuple[int, int, int, int]:
    """(BLOCK_M, GROUP_M, NUM_BLOCKS, BLOCK_K) for a format: 128x128 blocks take one
    block per program; 1xN tiles take 32 rows x 128 columns (or one N-wide block)."""
    cols = fmt.scaling.cols
    if fmt.scaling.rows == cols:
        return cols, cols, 1, cols
    return 32, 1, max(1, 128 // cols), cols


def fake_quant_2d(
    x: torch.Tensor, fmt: Format, generator: torch.Generator | None = None,
    tensor_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize-dequantize a contiguous 2-D tensor (blocks along dim 1) with the kernel
    (``tensor_amax``: the whole tensor's when ``x`` is a shard, as in ``fake_quant``)."""
    rows, cols = x.shape
    y = torch.empty_like(x)
    e, s = fmt.element, fmt.scaling
    if not s.needs_tensor_amax:
        tensor_amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    elif tensor_amax is None:
        tensor_amax = finite_amax(x, dims=(0, 1), keepdim=False)[0].reshape(1).float()
    else:
        tensor_amax = tensor_amax.reshape(1).float()
    seed, noise_bits = 0, 1
    if fmt.stochastic:
        gen_device = generator.device if generator is not None else torch.device("cpu")
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=gen_device))
        noise_bits = 24 - e.noise_int_bits
    block_m, group_m, num_blocks, block_k = _launch_shape(fmt)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, num_blocks * block_k))
    is_float = isinstance(e, FloatElement)
    _fake_quant_kernel[grid](
        x, y, rows, cols, tensor_amax, seed,
        BLOCK_M=block_m, GROUP_M=group_m, NUM_BLOCKS=num_blocks, BLOCK_K=block_k,
        SCALING={AmaxScaling: _AMAX, MXScaling: _MX, NVScaling: _NV}[type(s)],
        ELEM_MAX=float(e.max), ELEM_EMAX=e.emax, ELEM_EMIN=e.emin if is_float else 0,
        ELEM_MBITS=e.mbits if is_float else 0, IS_INT=not is_float,
        DROP_BITS=e.max_significand_bits if isinstance(s, AmaxScaling) else 0,
        STOCHASTIC=fmt.stochastic, NOISE_BITS=noise_bits, OUT_BF16=x.dtype == torch.bfloat16,
        num_warps=8 if block_m * num_blocks * block_k >= 8192 else 4,
        enable_fp_fusion=False,
    )  # fmt: skip
    return y
