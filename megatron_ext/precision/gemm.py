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
weight is what backward keeps.

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
from megatron_ext.precision.site_formats import GemmOperands


def quantize(t: torch.Tensor, fmt: Format | None, axis: int, group=None) -> torch.Tensor:
    """``fake_quant(t, fmt, axis=axis)``; ``t`` itself for passthrough and for a cast that
    cannot change ``t`` (to its own dtype, or to FP32 from BF16/FP16). ``group``: the
    tensor-parallel group ``t`` may be a shard over (see :func:`whole_tensor_amax`)."""
    if fmt is None:
        return t
    cast = getattr(fmt.element, "dtype", None)  # set for the IEEE casts only
    if cast is not None and torch.promote_types(t.dtype, cast) == cast:
        return t
    return fake_quant(t, fmt, axis=axis, tensor_amax=whole_tensor_amax(t, fmt, group))


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
    given, is the :class:`RecomputableWeight` whose ``value`` is ``weight``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                ops: GemmOperands, group=None, recompute: RecomputableWeight | None = None):
        w_fprop = quantize(weight, ops.fprop_w, axis=1, group=group)
        output = torch.matmul(quantize(x, ops.fprop_x, axis=-1, group=group), w_fprop.t())
        if bias is not None:
            output = output + bias
        ctx.ops, ctx.group, ctx.use_bias = ops, group, bias is not None
        ctx.rebuild = recompute.rebuild if recompute is not None else None
        if recompute is not None:
            ctx.save_for_backward(x, recompute.source)
        else:
            ctx.save_for_backward(x, w_fprop if ops.dgrad_reuses_fprop_w else weight)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, w = ctx.saved_tensors
        ops, group = ctx.ops, ctx.group
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = torch.matmul(quantize(grad_output, ops.dgrad_dy, -1, group),
                                      _dgrad_weight(ctx, w))
        dy = grad_output.contiguous().view(-1, grad_output.shape[-1])
        if ctx.needs_input_grad[1]:
            # along T: quantize dy.T (N, T) and x.T (K, T) along their last dim, which
            # fake_quant does without transposing its result back
            x2 = x.contiguous().view(-1, x.shape[-1])
            grad_weight = torch.matmul(quantize(dy.t(), ops.wgrad_dy, -1, group),
                                       quantize(x2.t(), ops.wgrad_x, -1, group).t())
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(dim=0)
        return grad_input, grad_weight, grad_bias, None, None, None


def _dgrad_weight(ctx, saved: torch.Tensor) -> torch.Tensor:
    """dgrad's weight operand (N, K) from what the forward saved: fprop's quantized weight,
    the weight to quantize along N, or the source of a :class:`RecomputableWeight`."""
    ops = ctx.ops
    if ctx.rebuild is not None:
        saved = ctx.rebuild(saved)
        if ops.dgrad_reuses_fprop_w:
            return quantize(saved, ops.fprop_w, axis=1, group=ctx.group)
    elif ops.dgrad_reuses_fprop_w:
        return saved
    # w along N = w.T (K, N) along its last dim; .t() of a passthrough w.t() is w
    return quantize(saved.t(), ops.dgrad_w, -1, ctx.group).t()


def quantized_gemm(x: torch.Tensor, weight: torch.Tensor | RecomputableWeight,
                   bias: torch.Tensor | None, ops: GemmOperands, group=None) -> torch.Tensor:
    """Apply :class:`QuantizedGemm` (autograd functions take no keywords); a
    :class:`RecomputableWeight` is rebuilt in the backward instead of kept."""
    if isinstance(weight, RecomputableWeight):
        return QuantizedGemm.apply(x, weight.value, bias, ops, group, weight)
    return QuantizedGemm.apply(x, weight, bias, ops, group)
