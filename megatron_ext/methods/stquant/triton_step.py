"""STQuant's state update as one Triton kernel: dequantize ``m`` / ``v``, torch's AdamW step,
requantize at the layer's (new) width — one read and one write of the codes, the parameter
and its gradient read once, the parameter written once.

A program holds ``ROWS`` whole quantization blocks, so a block's new scale (its amax) is
found in registers. The numerics are those of the CPU path, bit for bit:

* codes and scales exactly as :mod:`.quantizer` (linear: the formats package's ``int8@row`` /
  ``int4@row`` rules, or the 16-bit rule; logarithmic: the exact ladder of
  :func:`.quantizer.log_tables`, its cuts and rungs read from the same tables);
* the update as torch's single-tensor AdamW computes it on CPU (the vectorised ATen kernels):
  ``p *= 1 - lr wd``; ``m = fma(w, g - m, m)`` (``lerp``, ``w = 1 - beta1 < 0.5``; else
  ``fma(w - 1, g - m, g)``); ``v = fma((1 - beta2) g, g, v beta2)`` (``addcmul``);
  ``p += (-step_size m) / (sqrt(v) / sqrt(bc2) + eps)`` (``addcdiv``), with every scalar
  rounded to float32 as torch rounds it, ``div_rn`` / ``sqrt_rn``, contraction off.

Tested on CPU under ``TRITON_INTERPRET=1`` against the CPU path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from megatron_ext.formats.grid import cdiv
from megatron_ext.methods.stquant.quantizer import QState, empty_state, log_tables

__all__ = ["ROWS", "step", "supports"]

ROWS = 32
"""Quantization blocks per program (64 x 32 = 2048 values at the default block of 64)."""


def supports(p: torch.Tensor, block: int, old_bits: int, new_bits: int) -> bool:
    """Whether the kernel takes this update: a CUDA float32 parameter, a power-of-two block,
    and not 32 bits both before and after (that is plain AdamW, in place)."""
    return (p.is_cuda and p.dtype == torch.float32 and block & (block - 1) == 0 and block >= 2
            and (old_bits, new_bits) != (32, 32))


@triton.jit
def _load_linear(codes, scales, f, idx, valid, r, rows_ok, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Old ``m`` of the tile (``f``: padded flat index, ``idx``: the parameter's)."""
    if BITS == 32:
        return tl.load(codes + idx, mask=valid, other=0.0)
    ok = rows_ok[:, None]
    scale = tl.load(scales + r, mask=rows_ok, other=0.0)[:, None]
    if BITS == 16:
        return tl.load(codes + f, mask=ok, other=0).to(tl.float32) * scale
    if BITS == 8:
        c = tl.load(codes + f, mask=ok, other=0).to(tl.int32)
    else:
        c = tl.load(codes + f // 2, mask=ok, other=0).to(tl.int32)
        c = (c >> ((f & 1) * 4)) & 0xF
    mag = (c & ((1 << (BITS - 1)) - 1)).to(tl.float32) * scale
    return tl.where(c >> (BITS - 1) != 0, -mag, mag)


@triton.jit
def _load_log(codes, scales, rungs, f, idx, valid, r, rows_ok, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Old ``v`` of the tile: ``vmax * rungs[k]``."""
    if BITS == 32:
        return tl.load(codes + idx, mask=valid, other=0.0)
    ok = rows_ok[:, None]
    if BITS == 16:
        k = tl.load(codes + f, mask=ok, other=-32768).to(tl.int32) + 32768
    elif BITS == 8:
        k = tl.load(codes + f, mask=ok, other=0).to(tl.int32)
    else:
        k = (tl.load(codes + f // 2, mask=ok, other=0).to(tl.int32) >> ((f & 1) * 4)) & 0xF
    vmax = tl.load(scales + r, mask=rows_ok, other=0.0)[:, None]
    return vmax * tl.load(rungs + k)


@triton.jit
def _rint(x):
    """Round to the nearest integer, ties to even (|x| < 2**22)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _store_codes(codes, k, f, r, rows_ok, BITS: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Store the int32 codes ``k`` (``ROWS x BLOCK``): int16, uint8, or two per byte."""
    if BITS == 16:
        tl.store(codes + f, k.to(tl.int16), mask=rows_ok[:, None])
    elif BITS == 8:
        tl.store(codes + f, k.to(tl.uint8), mask=rows_ok[:, None])
    else:
        lo, hi = tl.split(tl.reshape(k, (ROWS, BLOCK // 2, 2)))
        half = r[:, None].to(tl.int64) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        tl.store(codes + half, (lo | (hi << 4)).to(tl.uint8), mask=rows_ok[:, None])


@triton.jit
def _store_linear(m, codes, scales, f, idx, valid, r, rows_ok, BITS: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """New ``m`` codes and per-block scales (quantizer ``_linear``)."""
    if BITS == 32:
        tl.store(codes + idx, m, mask=valid)
    else:
        amax = tl.max(tl.abs(m), axis=1)
        if BITS == 16:
            d = tl.math.div_rn(amax, tl.full(amax.shape, 32767.0, tl.float32))
            safe = tl.where(d > 0, d, 1.0)
            k = _rint(tl.math.div_rn(m, safe[:, None]))
            k = tl.minimum(tl.maximum(k, -32767.0), 32767.0).to(tl.int32)
        else:  # formats' int<BITS>@row: d = amax / Q, low significand bits cleared
            top: tl.constexpr = (1 << (BITS - 1)) - 1
            d = tl.math.div_rn(amax, tl.full(amax.shape, top, tl.float32))
            d = (d.to(tl.int32, bitcast=True) & -(1 << (BITS - 1))).to(tl.float32, bitcast=True)
            d = tl.maximum(d, 1.1754943508222875e-38)
            quant = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
            mag = tl.abs(_rint(m * quant[:, None])).to(tl.int32)
            k = mag | (((m.to(tl.int32, bitcast=True) >> 31) & 1) << (BITS - 1))
        _store_codes(codes, k, f, r, rows_ok, BITS, ROWS, BLOCK)
        tl.store(scales + r, d, mask=rows_ok)


@triton.jit
def _store_log(v, codes, scales, cuts, f, idx, valid, r, rows_ok, BITS: tl.constexpr,
               PER_OCTAVE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """New ``v`` codes and per-block maxima (quantizer ``_log``): the octave from the
    exponent bits, the rung inside it from a ``log2`` estimate corrected against ``cuts``."""
    if BITS == 32:
        tl.store(codes + idx, v, mask=valid)
    else:
        top: tl.constexpr = (1 << BITS) - 1
        vmax = tl.max(v, axis=1)
        safe = tl.where(vmax > 0, vmax, 1.0)
        ratio = tl.maximum(tl.math.div_rn(v, safe[:, None]), 1.1754943508222875e-38)
        bits = ratio.to(tl.int32, bitcast=True)
        mant = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
        c = tl.minimum(tl.maximum(tl.floor(tl.log2(mant) * PER_OCTAVE + 0.5), 0.0), PER_OCTAVE)
        c = c.to(tl.int32)
        up = (c < PER_OCTAVE) & (mant >= tl.load(cuts + tl.minimum(c, PER_OCTAVE - 1)))
        down = (c > 0) & (mant < tl.load(cuts + tl.maximum(c - 1, 0)))
        c = c + up.to(tl.int32) - down.to(tl.int32)
        k = top + ((bits >> 23) - 127) * PER_OCTAVE + c
        k = tl.where(v > 0, tl.minimum(tl.maximum(k, 1), top), 0)
        if BITS == 16:
            k = k - 32768
        _store_codes(codes, k, f, r, rows_ok, BITS, ROWS, BLOCK)
        tl.store(scales + r, vmax, mask=rows_ok)


@triton.jit
def _step_kernel(
    p_ptr, g_ptr, m_in, ms_in, v_in, vs_in, m_out, ms_out, v_out, vs_out, rungs, cuts,
    numel, lead, nblocks, decay, lerp_w, beta2, one_minus_beta2, bias2_sqrt, eps, neg_step,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, OLD_BITS: tl.constexpr, NEW_BITS: tl.constexpr,
    PER_OCTAVE: tl.constexpr, LERP_SMALL: tl.constexpr, DECAY: tl.constexpr,
):  # fmt: skip
    """One program: ROWS blocks of BLOCK values (the first block starts ``lead`` values
    before the parameter)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    f = r[:, None].to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[None, :]
    idx = f - lead
    valid = (idx >= 0) & (idx < numel)
    rows_ok = r < nblocks
    p = tl.load(p_ptr + idx, mask=valid, other=0.0)
    g = tl.load(g_ptr + idx, mask=valid, other=0.0)
    m = _load_linear(m_in, ms_in, f, idx, valid, r, rows_ok, OLD_BITS, BLOCK)
    v = _load_log(v_in, vs_in, rungs, f, idx, valid, r, rows_ok, OLD_BITS, BLOCK)
    if DECAY:
        p = p * decay
    if LERP_SMALL:
        m = tl.fma(g - m, lerp_w, m)
    else:
        m = tl.fma(g - m, lerp_w - 1.0, g)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), bias2_sqrt) + eps
    p = p + tl.math.div_rn(neg_step * m, denom)
    tl.store(p_ptr + idx, p, mask=valid)
    _store_linear(m, m_out, ms_out, f, idx, valid, r, rows_ok, NEW_BITS, ROWS, BLOCK)
    _store_log(v, v_out, vs_out, cuts, f, idx, valid, r, rows_ok, NEW_BITS, PER_OCTAVE, ROWS,
               BLOCK)  # fmt: skip


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    """The pointer passed where a 32-bit state has no scales or table (never read): one per
    device, not a fill kernel per parameter and step."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def step(p: torch.Tensor, grad: torch.Tensor, m: QState, v: QState, bits: int,
         scalars) -> tuple[QState, QState]:
    """Update the contiguous float32 ``p`` in place from ``grad`` and return the new ``m``,
    ``v`` at ``bits`` bits (``scalars``: an ``adamw.StepScalars``)."""
    nblocks = -(-(m.lead + m.numel) // m.block)
    m_new = empty_state(m, "linear", bits, nblocks)
    v_new = empty_state(v, "log", bits, nblocks)
    dummy = _placeholder(p.device)
    rungs = log_tables(m.bits, p.device)[0] if m.bits != 32 else dummy
    cuts = log_tables(bits, p.device)[1] if bits != 32 else dummy
    s = scalars
    _step_kernel[(cdiv(nblocks, ROWS),)](
        p, grad, m.codes, m.scales if m.bits != 32 else dummy, v.codes,
        v.scales if v.bits != 32 else dummy, m_new.codes, m_new.scales if bits != 32 else dummy,
        v_new.codes, v_new.scales if bits != 32 else dummy, rungs, cuts,
        m.numel, m.lead, nblocks, s.decay, s.lerp_weight, s.beta2, s.one_minus_beta2,
        s.bias2_sqrt, s.eps, s.neg_step_size,
        BLOCK=m.block, ROWS=ROWS, OLD_BITS=m.bits, NEW_BITS=bits, PER_OCTAVE=cuts.numel(),
        LERP_SMALL=abs(s.lerp_weight) < 0.5, DECAY=s.decay != 1.0, num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip
    return m_new, v_new
