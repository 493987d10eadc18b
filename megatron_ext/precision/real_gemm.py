"""Real FP8 GEMMs: a GEMM whose two operands are FP8 runs ``torch._scaled_mm`` on FP8 data.

The emulated GEMM (:mod:`.gemm`) fake-quantizes both operands and multiplies them in their
own dtype; the real one hands the tensor cores the FP8 values and their scales
(:func:`megatron_ext.formats.fp8.to_fp8`) and lets the FP32 accumulator apply the scales.
Every GEMM of a site is ``out = a @ b.T`` with ``a (M, R)`` and ``b (N, R)`` both blocked
along the reduction axis ``R`` (fprop: ``x, w``; dgrad: ``dy, w.T``; wgrad: ``dy.T, x.T``),
so one function runs all three. ``_scaled_mm`` takes ``b`` column-major — ``b.data.t()``
of our row-major ``(N, R)`` data is exactly that — and one scale layout per scaling kind:

=================  =========================  ==========================================
a x b scaling      scale_a                     scale_b
=================  =========================  ==========================================
tensor x tensor    0-d                         0-d
row x row          ``(M, 1)``                  ``(1, N)``
tile128 x block128 ``(M, R/128)``, column-     ``(R/128, N/128)``, i.e. our ``(N/128, R/128)``
                   major (outer dim first)     blocks transposed
tile128 x tile128  ``(M, R/128)`` as above     ``(R/128, N)``: our ``(N, R/128)`` transposed
=================  =========================  ==========================================

(Hopper's blockwise layouts, as torch's ``_scaled_mm`` documents them.) What a device can
run is found by trying: :func:`supported` runs each (dtypes, scalings, output dtype) once on a
512x512x512 problem, in each candidate scale layout, and compares with the float64 product
of the dequantized operands, so a layout torch does not take, or reads differently, is
never used, and a pairing no layout gets right falls back to emulation instead of training
on a wrong product. Shapes that the block sizes or the tensor cores' 16-element
alignment do not divide run emulated too, and so do blockwise GEMMs whose reduction length
is not a multiple of 512: on the H100 a trial with 2 scale blocks along the reduction was
accepted and came out wrong by 1e22, as if each scale row were read 4 values (16 bytes)
long, so only reductions of a multiple of 4 blocks are trusted (and tried).

Numerics: per GEMM, the real product is the exact product of the FP8 values and scales up
to the FP32 accumulator; the emulated one first rounds each ``q * d`` to the run's dtype.
In an FP32 run the two agree to FP32 rounding (``q * d`` needs up to 25 significand bits);
in a BF16 run the emulated GEMM rounds ``q * d`` to BF16, and the real one is the more
accurate of the two. fprop asks :func:`scaled_mm` for the tensor cores' fast accumulation,
granted for per-tensor scales where the device's trial with it passes
(:func:`fast_accumulates`; CPU ignores it); dgrad and wgrad accumulate as usual.
``--fp8-execution`` picks the path per run (:func:`wants_real`).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from megatron_ext.formats import Format, get_format
from megatron_ext.formats.fp8 import (FP8_DTYPES, Fp8Operand, block_shape, is_fp8_format, to_fp8,
                                      transposed)
from megatron_ext.precision.site_formats import GemmOperands, same_either_way

EXECUTION_CHOICES = ("auto", "real", "emulated")
"""``--fp8-execution`` values (see :func:`wants_real`)."""

_ALIGN = 16  # _scaled_mm: every dimension a multiple of 16
_BLOCK_ALIGN = 512  # blockwise: R / 128 scales per row, a multiple of 4 (16-byte rows)
_TRIAL = 512  # the trial GEMM's size: aligned for every scaling
FP8_TENSOR_CORES = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores (Ada; Hopper is 9.0)."""


def executes_real(mode: str, capability: tuple[int, int] | None) -> bool:
    """Whether ``--fp8-execution mode`` runs FP8 GEMMs for real on a device of this CUDA
    compute ``capability`` (None: the CPU): ``real`` on any device (CPU included, where torch
    runs per-tensor and per-row ``_scaled_mm``), ``auto`` on a GPU with FP8 tensor cores,
    ``emulated`` never. The real run asks it of its device (:func:`wants_real`), ``--dry-run``
    of the GPU its times assume."""
    if mode not in EXECUTION_CHOICES:
        raise ValueError(f"--fp8-execution must be one of {', '.join(EXECUTION_CHOICES)}")
    if mode == "auto":
        return capability is not None and capability >= FP8_TENSOR_CORES
    return mode == "real"


@lru_cache(maxsize=None)
def wants_real(mode: str, device: torch.device) -> bool:
    """:func:`executes_real` on ``device``."""
    return executes_real(mode, torch.cuda.get_device_capability(device)
                         if device.type == "cuda" else None)


def _kind(fmt: Format) -> str:
    s = fmt.scaling
    if s.rows is None and s.cols is None:
        return "tensor"
    if s.rows == 1 and s.cols is None:
        return "row"
    return f"{'tile' if s.rows == 1 else 'block'}{s.cols}"


_PAIRS = {("tensor", "tensor"), ("row", "row"), ("tile128", "block128"), ("tile128", "tile128")}
"""(a, b) scaling kinds ``_scaled_mm`` has a layout for (module docstring)."""


def runs_real(fmt_a: Format | None, fmt_b: Format | None, a, b) -> bool:
    """Whether ``a @ b.T`` in these formats can run as a real FP8 GEMM on ``a``'s device
    (``a (M, R)``, ``b (N, R)``: tensors, or anything with their ``shape``, ``dtype``,
    ``device``)."""
    if len(a.shape) != 2 or len(b.shape) != 2 or not fits_real(fmt_a, fmt_b, *a.shape,
                                                                b.shape[0]):
        return False
    return supported(str(fmt_a), str(fmt_b), a.dtype, a.device) is not None


def fits_real(fmt_a: Format | None, fmt_b: Format | None, m: int, r: int, n: int) -> bool:
    """Whether ``a (m, r) @ b (n, r).T`` in these formats has a real FP8 path where
    ``_scaled_mm`` takes every scaling pairing of the module table (an H100): both FP8,
    a pairing with a scale layout, and a shape the alignments and blocks divide. What
    :func:`runs_real` adds is the trial on the actual device (:func:`supported`)."""
    if not (is_fp8_format(fmt_a) and is_fp8_format(fmt_b)):
        return False
    if (_kind(fmt_a), _kind(fmt_b)) not in _PAIRS:
        return False
    if m % _ALIGN or n % _ALIGN or r % (_BLOCK_ALIGN if fmt_a.scaling.cols else _ALIGN):
        return False
    for fmt, rows in ((fmt_a, m), (fmt_b, n)):
        br, bc = block_shape(fmt, rows, r)
        if rows % br or r % bc:
            return False
    return True


def axis_free(fmt: Format | None) -> bool:
    """Whether ``fmt`` is FP8 and :func:`~.site_formats.same_either_way` (one scale per
    tensor, square blocks): its FP8 data then serves both GEMMs that read the operand,
    transposed (:func:`transposed`)."""
    return is_fp8_format(fmt) and same_either_way(fmt)


def fp8_x_serves_wgrad(ops: GemmOperands) -> bool:
    """Whether a real wgrad's ``x`` is fprop's FP8 ``q(x)`` transposed (one axis-free format
    for both): the forward then keeps ``q(x)`` in FP8 instead of ``x``."""
    return ops.wgrad_x == ops.fprop_x and axis_free(ops.fprop_x)


def fp8_gemm(a: torch.Tensor, fmt_a: Format, b: torch.Tensor, fmt_b: Format,
             amax_a=None, amax_b=None) -> torch.Tensor:
    """``q(a) @ q(b).T`` on the FP8 tensor cores, in ``a``'s dtype (``a (M, R)``, ``b (N, R)``;
    ``amax_*``: whole-tensor amaxes of TP shards, see ``gemm.whole_tensor_amax``)."""
    return scaled_mm(to_fp8(a, fmt_a, amax_a), to_fp8(b, fmt_b, amax_b), a.dtype)


def scaled_mm(a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype,
              layout: int | None = None, fast_accum: bool = False) -> torch.Tensor:
    """``(a.data * a.scale) @ (b.data * b.scale).T`` by ``torch._scaled_mm`` (layouts above;
    ``layout``: which of :func:`_scales`' candidates, by default the one :func:`supported`
    found right on this device). ``fast_accum``: ask for the tensor cores' fast FP8
    accumulation (``use_fast_accum``; fprop's, as in Transformer Engine and torchao),
    granted where :func:`fast_accumulates` (a given ``layout`` takes it as asked)."""
    if layout is None:
        fmt_a, fmt_b, device = str(a.fmt), str(b.fmt), a.data.device
        fast_accum = fast_accum and fast_accumulates(fmt_a, fmt_b, out_dtype, device)
        layout = supported(fmt_a, fmt_b, out_dtype, device, fast_accum)
    scale_a, scale_b = _scales(a, b)[layout or 0]
    fast = {"use_fast_accum": True} if fast_accum else {}
    return torch._scaled_mm(a.data, b.data.t(), scale_a=scale_a, scale_b=scale_b,
                            out_dtype=out_dtype, **fast)


@lru_cache(maxsize=None)
def fast_accumulates(fmt_a: str, fmt_b: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a GEMM that asks for fast accumulation gets it: per-tensor scales (the fast
    recipe; blockwise and per-row GEMMs accumulate as usual) whose :func:`supported` trial
    with it comes out right on this device."""
    return (_kind(get_format(fmt_a)) == "tensor"
            and supported(fmt_a, fmt_b, dtype, device, True) is not None)


def _scales(a: Fp8Operand, b: Fp8Operand) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Candidate ``(scale_a, scale_b)`` layouts for the operands' scaling kinds, the
    documented one first (blockwise: the same shapes, stored outer- or inner-dim-major)."""
    kind_a = _kind(a.fmt)
    if kind_a == "tensor":
        return [(a.scale.reshape(()), b.scale.reshape(()))]
    if kind_a == "row":
        return [(a.scale.reshape(-1)[:, None], b.scale.reshape(-1)[None, :])]
    a_outer, b_t = a.scale.t().contiguous().t(), b.scale.t()
    return [(a_outer, b_t), (a_outer, b_t.contiguous()), (a.scale, b_t.contiguous()),
            (a.scale, b_t), (a_outer, b.scale), (a.scale, b.scale)]


TRIALS: dict[tuple, list[str]] = {}
"""What each :func:`supported` trial saw, per candidate layout (for ``gpu_check``)."""


@lru_cache(maxsize=None)
def supported(fmt_a: str, fmt_b: str, dtype: torch.dtype, device: torch.device,
              fast_accum: bool = False) -> int | None:
    """The layout (index into :func:`_scales`) with which this device's ``_scaled_mm`` runs
    ``fmt_a x fmt_b`` with ``dtype`` output (and ``fast_accum``) and gets it right, or None
    (one 512x512x512 trial per candidate against the float64 product; cached)."""
    fa, fb = get_format(fmt_a), get_format(fmt_b)
    gen = torch.Generator(device="cpu").manual_seed(0)
    steps = torch.arange(_TRIAL)  # block amaxes 2**0..2**7 apart: a misread layout shows
    spread = 2.0 ** (steps % 5)[:, None] * 2.0 ** (steps // 128)[None, :]
    a = (torch.randn(_TRIAL, _TRIAL, generator=gen) * spread).to(device=device, dtype=dtype)
    b = (torch.randn(_TRIAL, _TRIAL, generator=gen) * spread.t()).to(device=device, dtype=dtype)
    qa, qb = to_fp8(a, fa), to_fp8(b, fb)
    ref = (_dequantized(qa) @ _dequantized(qb).t()).float()
    seen = TRIALS.setdefault((fmt_a, fmt_b, dtype, str(device), fast_accum), [])
    for layout in range(len(_scales(qa, qb))):
        try:
            out = scaled_mm(qa, qb, dtype, layout, fast_accum).float()
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            seen.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        error = ((out - ref).abs().max() / ref.abs().max()).item()
        seen.append(f"max error {error:.2e} of the largest output")
        if error < 2e-2:
            return layout
    return None


def _dequantized(op: Fp8Operand) -> torch.Tensor:
    """``data * scale`` per block in float64, exact (the reference of :func:`supported`)."""
    rows, cols = op.data.shape
    br, bc = rows // op.scale.shape[0], cols // op.scale.shape[1]
    values = op.data.double().view(op.scale.shape[0], br, op.scale.shape[1], bc)
    return (values * op.scale.double()[:, None, :, None]).view(rows, cols)


def describe(mode: str, device: torch.device) -> str:
    """One start-up line: where FP8 GEMMs run, and which scalings this device runs for real."""
    if not wants_real(mode, device):
        why = "--fp8-execution emulated" if mode == "emulated" else f"no FP8 tensor cores on {device}"
        return f"precision: FP8 GEMMs emulated ({why}); FP4 / MX / NVFP4 are always emulated"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pairs = [(a, b) for a, b in (("fp8_e4m3", "fp8_e4m3"), ("fp8_e4m3@row", "fp8_e4m3@row"),
                                 ("fp8_e4m3@tile128", "fp8_e4m3@block128"),
                                 ("fp8_e4m3@tile128", "fp8_e4m3@tile128"))]
    real = [f"{_kind(get_format(a))}x{_kind(get_format(b))}" for a, b in pairs
            if supported(a, b, dtype, device) is not None]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return (f"precision: FP8 GEMMs real (torch._scaled_mm) on {name} for "
            f"{', '.join(real) or 'no scaling'}; other FP8 scalings, FP4 / MX / NVFP4 emulated")


__all__ = ["EXECUTION_CHOICES", "FP8_DTYPES", "axis_free", "describe", "executes_real",
           "fast_accumulates",
           "fits_real", "fp8_gemm", "fp8_x_serves_wgrad", "runs_real", "scaled_mm", "supported",
           "transposed", "wants_real"]
