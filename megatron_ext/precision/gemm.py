"""The quantized GEMM: one linear site's three GEMMs, each on fake-quantized operands.

A linear site computes ``y = x @ w.T`` with ``x: (T, K)`` (T tokens, K input features) and
``w: (N, K)`` (N output features). Training runs three GEMMs, and each quantizes its two
operands in blocks that run along **its own reduction dimension** — the dimension a
tensor-core MMA sums over, so one scale per block can be pulled out of each partial sum:

    ==========  =====================  ==========  ===============  ===============
    GEMM        product                reduces     first operand    second operand
    ==========  =====================  ==========  ===============  ===============
    fprop       y  = q(x)  @ q(w).T    K           x along K (-1)   w along K (1)
    dgrad       dx = q(dy) @ q(w)      N           dy along N (-1)  w along N (0)
    wgrad       dw = q(dy).T @ q(x)    T           dy along T (0)   x along T (0)
    ==========  =====================  ==========  ===============  ===============

(``q`` = ``fake_quant(t, fmt, axis=...)``; the axis in brackets is the tensor dimension the
blocks run along, with x and dy flattened to ``(T, ·)``.)

So ``x`` is quantized twice, differently: in 1x128 tiles along K for fprop and along T for
wgrad; likewise ``dy`` (along N, then along T). A tile-scaled weight would also differ between
fprop and dgrad — the transposed tensor has other blocks, other amaxes, so the weight the
backward pass sees is not the weight the forward pass used (GaussWS §2.1 calls the resulting
forward/backward mismatch an oscillation risk). A **128x128 block** is the same block from
either side, so a block-scaled weight is quantized once and the same ``q(w)`` serves fprop and
dgrad (DeepSeek-V3's choice, which SNIP follows: 1x128 tiles for x and dy, 128x128 blocks for
w); :attr:`GemmOperands.dgrad_reuses_fprop_w` says when that holds, and then the quantized
weight is what backward keeps. Likewise for ``x`` and ``dy`` in a format that ignores the axis
(:func:`~.site_formats.same_either_way`: one scale per tensor, square blocks): the forward
keeps ``q(x)`` in ``x``'s place and wgrad reads it, and wgrad reads dgrad's ``q(dy)``
transposed (``GemmOperands.wgrad_reuses_fprop_x`` / ``wgrad_reuses_dgrad_dy``) — three
quantizations per site and micro-batch instead of five for ``uniform:fp4-tensor``. An ``x``
that its producer keeps anyway (``own_x`` False: fused attention's output entering ``proj``)
is kept itself and quantized again: keeping ``q(x)`` as well would hold two copies.

Everything else stays high precision: the GEMM's output is in the operands' dtype (BF16 or
FP32 — on hardware an FP32 accumulator written out in that dtype), the bias and its gradient
are unquantized, and the weight handed in is the model's parameter, which megatron's optimizer
keeps an FP32 master copy of. Under tensor parallelism each rank quantizes its shard; a format
with one scale for the whole tensor (``fp8_e4m3``, ``fp4_e2m1``; NVFP4's second level) takes
the amax of the whole tensor, a MAX all-reduce over the TP group (Transformer Engine's amax
reduction), so the shard is quantized as the unsharded tensor is. Block and tile scales are
local to their blocks: equal to the unsharded tensor's wherever no block straddles a shard
edge. Stochastic-rounding formats (``+sr``, SNIP's FP4 ``dy``) draw
from torch's default generator, whose state the checkpoint saves.

**Recomputable weights.** A weight operand transform (a method's ŵ = f(w), see
:mod:`.layers`) may hand the GEMM a :class:`RecomputableWeight` instead of a tensor: ŵ plus
the tensor it was made from and a function that rebuilds ŵ from it bit for bit. The GEMM
then saves the source (the parameter, alive anyway) where it would save ŵ, and rebuilds ŵ
in the backward for dgrad: no ŵ-sized tensor outlives the forward. Where dgrad reuses
fprop's quantized weight (above), that quantized copy is not kept either: the backward
rebuilds ŵ and quantizes it again with fprop's format — the same ``q(ŵ)`` bit for bit,
since :attr:`GemmOperands.dgrad_reuses_fprop_w` implies a deterministic format (a
tensor-wide scale repeats its amax all-reduce there) — trading one more quantization for
the copy's memory. ŵ's gradient is dgrad's usual ``dw``; autograd routes it into the
transform's own backward.

**Weights once per step.** With a :class:`~.weight_cache.WeightCache` (the layer's) fprop's
quantized weight comes from the step's first micro-batch: the emulated one where dgrad
reuses it (backward keeps it anyway), the real FP8 one always; so does a real FP8 dgrad's
``q(w)`` along N, which per tensor is fprop's transposed, written by the same cast.

**Real FP8 GEMMs.** With ``real`` set (``--fp8-execution``), a GEMM whose two operands are
both amax-scaled FP8 formats runs on FP8 data with ``torch._scaled_mm`` instead
(:mod:`.real_gemm`), one GEMM at a time: a site may run fprop real and wgrad emulated; fprop
asks for fast accumulation. Its forward then keeps the unquantized weight, and dgrad's
``q(w)`` along N comes from the cache or is quantized by dgrad. Where an operand's format is
axis-free (one scale per tensor, square blocks) its FP8 data serves both GEMMs that read it,
transposed, and the cast that makes it writes the transpose too
(:func:`~megatron_ext.formats.fp8.to_fp8_pair`): the forward keeps ``q(x).T`` in FP8 for
wgrad instead of ``x`` (half the bytes in BF16; under sequence parallelism its rows of
``q(x)``, transposed by wgrad), and wgrad reads dgrad's ``q(dy).T``.

The backward is *not* autograd of the quantized forward: with straight-through estimators
autograd would reuse fprop's ``q(w)`` and ``q(x)`` along K, where the hardware GEMMs quantize
along N and T. Each gradient here is exactly the product its GEMM row above names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ext.formats import Format, fake_quant
from megatron_ext.formats.amax import finite_amax
from megatron_ext.formats.fp8 import Fp8Operand, to_fp8, to_fp8_pair, transposed
from megatron_ext.precision.real_gemm import axis_free, fp8_x_serves_wgrad, runs_real, scaled_mm
from megatron_ext.precision.site_formats import GemmOperands
from megatron_ext.precision.weight_cache import WeightCache


def quantize(t: torch.Tensor, fmt: Format | None, axis: int, group=None) -> torch.Tensor:
    """``fake_quant(t, fmt, axis=axis)``; ``t`` itself for passthrough and for a cast that
    cannot change ``t`` (to its own dtype, or to FP32 from BF16/FP16). ``group``: the
    tensor-parallel group ``t`` may be a shard over (see :func:`whole_tensor_amax`)."""
    if not changes(fmt, t.dtype):
        return t
    return fake_quant(t, fmt, axis=axis, tensor_amax=whole_tensor_amax(t, fmt, group))


def changes(fmt: Format | None, dtype: torch.dtype) -> bool:
    """Whether :func:`quantize` of a ``dtype`` tensor in ``fmt`` makes a new tensor (False
    for passthrough and for a cast that cannot change it)."""
    if fmt is None:
        return False
    cast = getattr(fmt.element, "dtype", None)  # set for the IEEE casts only
    return cast is None or torch.promote_types(dtype, cast) != cast


def whole_tensor_amax(t: torch.Tensor, fmt: Format, group) -> torch.Tensor | None:
    """The largest finite magnitude over every rank's ``t`` in ``group`` when ``fmt`` has a
    tensor-wide scale and the group has several ranks (a collective: every rank of the group
    calls it for the same operand); None otherwise. A replicated operand gets its own amax."""
    if group is None or not fmt.scaling.reads_tensor_amax or dist.get_world_size(group) == 1:
        return None
    amax = finite_amax(t, tuple(range(t.ndim)), keepdim=False)[0].float()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


@dataclass(frozen=True)
class RecomputableWeight:
    """A weight operand the GEMM may rebuild in its backward instead of keeping it."""

    value: torch.Tensor
    """The transformed weight (ŵ), with autograd: its gradient reaches the transform."""
    source: torch.Tensor
    """The tensor ŵ is made from (the parameter w, kept alive anyway): what the GEMM saves."""
    rebuild: Callable[[torch.Tensor], torch.Tensor]
    """``rebuild(source)``: ``value``'s data bit for bit, no autograd (same key, same ŵ)."""


class QuantizedGemm(torch.autograd.Function):
    """``y = x @ w.T + b`` with the operand formats of one site (see the module docstring).

    ``x`` may have leading dims (megatron passes ``[s, b, K]``); ``ops`` is read when the
    function is applied, so changing a layer's formats between steps needs no rebuild;
    ``group`` is the layer's tensor-parallel group (None without TP); ``recompute``, when
    given, is the :class:`RecomputableWeight` whose ``value`` is ``weight``; ``real``,
    ``cache``, ``own_x`` and ``seq_group`` as in :func:`quantized_gemm`.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                ops: GemmOperands, group=None, recompute: RecomputableWeight | None = None,
                real: bool = False, cache: WeightCache | None = None, own_x: bool = True,
                seq_group=None):
        x2 = x.reshape(-1, x.shape[-1])
        wgrad_real = real and _wgrad_runs_real(ops, x2, weight)
        kept_x, fp8_x, x_quantized = x, (None, None), False
        ctx.x_t = False  # whether the FP8 q(x) kept for wgrad is stored transposed
        if real and runs_real(ops.fprop_x, ops.fprop_w, x2, weight):
            output, qx = _real_fprop(ctx, x2, weight, ops, group, cache,
                                     wgrad_real and fp8_x_serves_wgrad(ops), seq_group is None)
            output = output.view(*x.shape[:-1], output.shape[-1])
            kept_w = weight  # dgrad's q(w) along N: the cache's, else quantized by dgrad
            if qx is not None:  # wgrad reads q(x): keep it in FP8
                kept_x, fp8_x = None, (qx.data, qx.scale)
        else:
            w_fprop = _cached(cache if ops.dgrad_reuses_fprop_w else None, ("fake", ops.fprop_w),
                              lambda: quantize(weight, ops.fprop_w, axis=1, group=group))
            qx = quantize(x, ops.fprop_x, axis=-1, group=group)
            output = torch.matmul(qx, w_fprop.t())
            kept_w = w_fprop if ops.dgrad_reuses_fprop_w else weight
            if own_x and not wgrad_real and ops.wgrad_reuses_fprop_x:
                kept_x, x_quantized = qx, True  # also wgrad's q(x) along T: kept instead of x
        if bias is not None:
            output = output + bias
        ctx.ops, ctx.group, ctx.use_bias = ops, group, bias is not None
        ctx.real, ctx.wgrad_real = real, wgrad_real
        ctx.w_quantized, ctx.x_quantized = kept_w is not weight, x_quantized
        ctx.rebuild = recompute.rebuild if recompute is not None else None
        ctx.seq_group, ctx.cache = seq_group, cache
        if seq_group is not None:  # keep this rank's rows of the gathered x (or q(x))
            kept_x, fp8_x = _own_rows(kept_x, seq_group), (_own_rows(fp8_x[0], seq_group),
                                                           fp8_x[1])
        ctx.save_for_backward(kept_x, recompute.source if recompute is not None else kept_w,
                              *fp8_x)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, w, x8, x8_scale = ctx.saved_tensors
        if ctx.seq_group is not None:
            x, x8 = _all_rows(x, ctx.seq_group), _all_rows(x8, ctx.seq_group)
        ops = ctx.ops
        grad_input = grad_weight = grad_bias = qdy = None
        dy = grad_output.contiguous().view(-1, grad_output.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_input, qdy = _dgrad(ctx, dy, w)
            grad_input = grad_input.view(*grad_output.shape[:-1], -1)
        if ctx.needs_input_grad[1]:
            qx = Fp8Operand(x8, x8_scale, ops.fprop_x) if x8 is not None else None
            grad_weight = _wgrad(ctx, dy, qdy, x, qx if qx is None or ctx.x_t else transposed(qx))
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(dim=0)
        if ctx.cache is not None:
            ctx.cache.end_backward()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


def _own_rows(t: torch.Tensor | None, group) -> torch.Tensor | None:
    """This rank's rows of ``t``, which was gathered along dim 0 over ``group`` in rank
    order: a copy, so that the gathered tensor can be freed."""
    if t is None:
        return None
    return t.chunk(dist.get_world_size(group), 0)[dist.get_rank(group)].clone()


def _all_rows(t: torch.Tensor | None, group) -> torch.Tensor | None:
    """Every rank's :func:`_own_rows` of ``group`` gathered again, in rank order (FP8 data
    travels as bytes: not every backend gathers FP8 dtypes)."""
    if t is None:
        return None
    data = t.view(torch.uint8) if t.element_size() == 1 else t
    out = data.new_empty((data.shape[0] * dist.get_world_size(group), *data.shape[1:]))
    dist.all_gather_into_tensor(out, data.contiguous(), group=group)
    return out.view(t.dtype)


def _cached(cache: WeightCache | None, key: tuple, make):
    """fprop's quantized weight: from ``cache`` when one is given (:mod:`.weight_cache`)."""
    return make() if cache is None else cache.get(key, make)


def _real_fprop(ctx, x2: torch.Tensor, weight: torch.Tensor, ops: GemmOperands, group,
                cache: WeightCache | None, keep_x: bool, x_t: bool):
    """``(y, q(x) for wgrad or None)``: fprop on FP8 data with fast accumulation. ``keep_x``:
    wgrad reads fprop's ``q(x)``, kept in FP8; ``x_t``: kept transposed, written by the
    same cast (not under sequence parallelism, whose backward gathers rows)."""
    ctx.x_t = keep_x and x_t
    qx, kept = (_to_fp8_pair(x2, ops.fprop_x, group) if ctx.x_t else
                (_to_fp8(x2, ops.fprop_x, group),) * 2)
    qw = _fp8_fprop_weight(weight, ops, group, cache, lambda: ctx.needs_input_grad[0]
                           and _dgrad_runs_real(ops, x2, weight))
    return scaled_mm(qx, qw, x2.dtype, fast_accum=True), kept if keep_x else None


def _fp8_fprop_weight(weight: torch.Tensor, ops: GemmOperands, group,
                      cache: WeightCache | None, dgrad_real: Callable[[], bool]) -> Fp8Operand:
    """fprop's FP8 ``q(w)``, from the step's first forward where there is a ``cache``; where
    a backward follows whose dgrad runs real (``dgrad_real()``) on the same values
    transposed (the weight format axis-free in both GEMMs), that forward's cast writes the
    transpose too, which the cache keeps for the step's backwards."""
    def make():
        if not (cache.backward_follows and ops.dgrad_reuses_fprop_w and dgrad_real()):
            return _to_fp8(weight, ops.fprop_w, group)
        qw, qw_t = _to_fp8_pair(weight, ops.fprop_w, group)
        cache.keep_for_backward(("fp8", ops.dgrad_w), qw_t)
        return qw

    if cache is None:
        return _to_fp8(weight, ops.fprop_w, group)
    return cache.get(("fp8", ops.fprop_w), make)


def _fp8_dgrad_weight(w: torch.Tensor, ops: GemmOperands, group,
                      cache: WeightCache | None) -> Fp8Operand:
    """dgrad's FP8 ``q(w)`` along N, ``(K, N)``: the cache's for the step (made with fprop's
    or by the step's first dgrad), or quantized now."""
    def make():
        return _to_fp8(w.t(), ops.dgrad_w, group)

    return make() if cache is None else cache.get_for_backward(("fp8", ops.dgrad_w), make)


def _wgrad_runs_real(ops: GemmOperands, x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether wgrad's operands dy.T (N, T) and x.T (K, T) can run a real FP8 GEMM (their
    shapes, from the forward's ``x2 (T, K)`` and ``weight (N, K)``)."""
    tokens, k = x2.shape
    return runs_real(ops.wgrad_dy, ops.wgrad_x, x2.as_strided((weight.shape[0], tokens), (0, 0)),
                     x2.as_strided((k, tokens), (0, 0)))


def _dgrad_runs_real(ops: GemmOperands, x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether dgrad's operands dy (T, N) and w.T (K, N) can run a real FP8 GEMM (shapes as
    in :func:`_wgrad_runs_real`)."""
    tokens, k = x2.shape
    n = weight.shape[0]
    return runs_real(ops.dgrad_dy, ops.dgrad_w, x2.as_strided((tokens, n), (0, 0)),
                     x2.as_strided((k, n), (0, 0)))


def _to_fp8(t: torch.Tensor, fmt: Format, group) -> Fp8Operand:
    """``t`` in FP8 (:func:`~megatron_ext.formats.fp8.to_fp8`), TP shards scaled as wholes."""
    return to_fp8(t, fmt, whole_tensor_amax(t, fmt, group))


def _to_fp8_pair(t: torch.Tensor, fmt: Format, group) -> tuple[Fp8Operand, Fp8Operand]:
    """``t`` in FP8 and transposed (:func:`~megatron_ext.formats.fp8.to_fp8_pair`), one cast
    for both GEMMs that read it; TP shards scaled as wholes."""
    return to_fp8_pair(t, fmt, whole_tensor_amax(t, fmt, group))


def _dgrad(ctx, dy: torch.Tensor, saved: torch.Tensor):
    """``(dx, q(dy))``: dx = q(dy) @ q(w) with ``dy`` flattened to ``(T, N)``, real FP8 where
    the forward kept the unquantized weight and the formats allow (``q(dy)``: its FP8
    transpose, written by the same cast, where a real wgrad reads it, else None), else
    emulated (``q(dy)`` fake-quantized where wgrad reuses it, else None)."""
    ops = ctx.ops
    if ctx.real and not ctx.w_quantized:
        w = ctx.rebuild(saved) if ctx.rebuild is not None else saved
        if runs_real(ops.dgrad_dy, ops.dgrad_w, dy, w.t()):
            reuse_dy = ctx.wgrad_real and ops.wgrad_dy == ops.dgrad_dy and axis_free(ops.wgrad_dy)
            qdy, qdy_t = (_to_fp8_pair(dy, ops.dgrad_dy, ctx.group) if reuse_dy else
                          (_to_fp8(dy, ops.dgrad_dy, ctx.group), None))
            qw = _fp8_dgrad_weight(w, ops, ctx.group, ctx.cache)  # None for a rebuilt ŵ
            return scaled_mm(qdy, qw, dy.dtype), qdy_t
    qdy = quantize(dy, ops.dgrad_dy, -1, ctx.group)
    reused = qdy if not ctx.wgrad_real and ops.wgrad_reuses_dgrad_dy else None
    return torch.matmul(qdy, _dgrad_weight(ctx, saved)), reused


def _wgrad(ctx, dy: torch.Tensor, qdy: Fp8Operand | torch.Tensor | None,
           x: torch.Tensor | None, qx: Fp8Operand | None) -> torch.Tensor:
    """dw = q(dy).T @ q(x), both along T: real FP8 where the formats allow, reading dgrad's
    ``q(dy)`` and the forward's FP8 ``q(x)``, both transposed already, where their formats are
    axis-free; else emulated: dgrad's fake-quantized ``q(dy)`` and the forward's ``q(x)`` where they
    serve along T too (:func:`.site_formats.same_either_way`), otherwise dy.T (N, T) and
    x.T (K, T) quantized along their last dim (fake_quant does not transpose back)."""
    ops, group = ctx.ops, ctx.group
    x2 = x.contiguous().view(-1, x.shape[-1]) if x is not None else None
    if ctx.wgrad_real:
        a = qdy if isinstance(qdy, Fp8Operand) else _to_fp8(dy.t(), ops.wgrad_dy, group)
        b = qx if qx is not None else _to_fp8(x2.t(), ops.wgrad_x, group)
        return scaled_mm(a, b, dy.dtype)
    a = qdy.t() if isinstance(qdy, torch.Tensor) else quantize(dy.t(), ops.wgrad_dy, -1, group)
    b = x2 if ctx.x_quantized else quantize(x2.t(), ops.wgrad_x, -1, group).t()
    return torch.matmul(a, b)


def _dgrad_weight(ctx, saved: torch.Tensor) -> torch.Tensor:
    """dgrad's weight operand (N, K) from what the forward saved: fprop's quantized weight,
    the weight to quantize along N, or the source of a :class:`RecomputableWeight`."""
    ops = ctx.ops
    if ctx.rebuild is not None:
        saved = ctx.rebuild(saved)
        if ops.dgrad_reuses_fprop_w:
            return quantize(saved, ops.fprop_w, axis=1, group=ctx.group)
    elif ctx.w_quantized:  # fprop's q(w), kept by an emulated forward
        return saved
    # w along N = w.T (K, N) along its last dim; .t() of a passthrough w.t() is w
    return quantize(saved.t(), ops.dgrad_w, -1, ctx.group).t()


def quantized_gemm(x: torch.Tensor, weight: torch.Tensor | RecomputableWeight,
                   bias: torch.Tensor | None, ops: GemmOperands, group=None,
                   real: bool = False, cache: WeightCache | None = None,
                   own_x: bool = True, seq_group=None) -> torch.Tensor:
    """Apply :class:`QuantizedGemm` (autograd functions take no keywords); a
    :class:`RecomputableWeight` is rebuilt in the backward instead of kept; ``real``: run
    the GEMMs whose operands are both FP8 on the FP8 tensor cores (:mod:`.real_gemm`);
    ``cache``: the layer's :class:`~.weight_cache.WeightCache` (a plain weight only), whose
    :meth:`~.weight_cache.WeightCache.start_forward` the caller made for this forward;
    ``own_x``: whether ``x`` is the GEMM's alone, so that an emulated ``q(x)`` that serves
    wgrad too may be kept in its place (False where ``x``'s producer keeps it: fused
    attention's output entering ``proj``; then ``x`` is kept and wgrad quantizes it);
    ``seq_group``: the group ``x`` was gathered over along dim 0 (sequence parallelism), so
    that only this rank's rows of what wgrad reads are kept and the backward gathers them
    again, as megatron's own linear does."""
    if isinstance(weight, RecomputableWeight):
        return QuantizedGemm.apply(x, weight.value, bias, ops, group, weight, real, None, own_x,
                                   seq_group)
    return QuantizedGemm.apply(x, weight, bias, ops, group, None, real, cache, own_x, seq_group)
