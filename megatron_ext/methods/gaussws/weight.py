"""The learnable bit widths of one sampled weight (eq. 9, 10, 6) and the module tying them to
eq. 1: what the wiring attaches to each sampled linear.

**Eq. 9.** Each tile's bit width is ``b_t = b_decay + b_i · (b_init - b_decay)`` with the
internal parameter ``b_i`` initialised to 1 (so b_t starts at b_init), ``b_decay`` the
paper's b_target "for weight decay" (``--gaussws-b-target-decay``). Plain (decoupled) weight
decay on ``b_i`` pulls it towards 0, i.e. b_t towards b_decay; ``∂L/∂b_i =
(b_init - b_decay) · ∂L/∂b_t`` comes from autograd through this affine map.

**Eq. 6.** ``b_t`` is clamped at the GEMM format's underflow bound (``max_bits``, see
:func:`.sampling.underflow_bound`): above it the gradient is 0, like any clamp, so weight
decay brings b_i back under it.

**Eq. 10** (λ > 0): ``L' = L + λ/n Σ_i |b_t^i - b_loss|`` (b_loss: the paper's b_target "for
the bitwidth loss", ``--gaussws-b-target-loss``) over all n tiles of all
sampled weights (:func:`bitwidth_loss`; under pipeline parallelism each stage adds its own
tiles' terms with the model-wide n).

``b_i`` is a full tile grid (``ceil(M/32) x ceil(N/32)``, 1/1024 of the weight) replicated
on every TP rank of the layer: its gradient arrives complete on each rank (the sampling
backward all-reduces over the TP group), so replicas stay equal. It has no
``tensor_model_parallel`` attribute, which megatron reads as "a TP duplicate": counted once
in the gradient norm, replicated in checkpoints, not reduced again after the backward (so
an eq. 10 term added on every TP rank counts once).
"""

from __future__ import annotations

import math

import torch

from megatron_ext.precision.gemm import RecomputableWeight

from .flags import GaussWSConfig
from .layout import ShardLayout, all_reduce_block_amax, local_block_amax
from .sampling import bits_grad, block_scale, recomputable_sample


class GaussWSWeight(torch.nn.Module):
    """ŵ of one (local shard of a) weight: the b_i parameter plus the sampling call."""

    def __init__(self, layout: ShardLayout, config: GaussWSConfig, device=None):
        super().__init__()
        self.layout = layout
        self.b_init, self.b_decay = config.b_init, config.b_target_decay
        self.b_i = torch.nn.Parameter(torch.ones(layout.grid_shape, device=device))
        self._amax: tuple = (None, None)
        """((key, w's storage), tile maxima) of the last :meth:`tile_amax`."""

    def bits(self, max_bits: float | None = None) -> torch.Tensor:
        """b_t per tile (eq. 9), clamped at ``max_bits`` (eq. 6) when given."""
        b = self.b_decay + self.b_i * (self.b_init - self.b_decay)
        return b if max_bits is None else b.clamp(max=max_bits)

    def forward(self, w: torch.Tensor, key: int, max_bits: float | None = None, group=None,
                defer_bits_grad: bool = False) -> torch.Tensor:
        """ŵ (eq. 1): :meth:`sample`'s value."""
        return self.sample(w, key, max_bits, group, defer_bits_grad).value

    def sample(self, w: torch.Tensor, key: int, max_bits: float | None = None, group=None,
               defer_bits_grad: bool = False) -> RecomputableWeight:
        """ŵ (eq. 1) of the local weight ``w`` with the step's ``key``, as a weight the
        quantized GEMM rebuilds in its backward instead of keeping; ``group`` is the layer's
        TP group when ``w`` is a shard (tile maxima and b_t gradients are reduced over it).
        With ``defer_bits_grad`` the backward only passes ∂L/∂ŵ to w (no R regeneration):
        call :meth:`accumulate_bits_grad` once per step instead."""
        bits = self.bits(max_bits)
        return recomputable_sample(w, bits.detach() if defer_bits_grad else bits, key,
                                   self.layout, group, self.tile_amax(w, key, group))

    def tile_amax(self, w: torch.Tensor, key: int, group=None) -> torch.Tensor:
        """The tile maxima of ``w`` (over the TP ``group``), made once per ``key``: a key
        names one optimizer step, whose micro-batches all sample the same weights (they
        change only between steps), so the step's first forward measures them and the
        others, and :meth:`accumulate_bits_grad`, reuse them (one pass over ``w`` and one
        all-reduce a step, not one per micro-batch)."""
        tag = (key, w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape))
        if self._amax[0] != tag:
            self._amax = tag, all_reduce_block_amax(local_block_amax(w, self.layout), group)
        return self._amax[1]

    def accumulate_bits_grad(self, w: torch.Tensor, w_grad: torch.Tensor, key: int,
                             max_bits: float | None = None, group=None) -> None:
        """Add eq. 3's ∂L/∂b_i for a whole step to ``b_i.grad`` from the weight's gradient
        accumulated over the step's micro-batches. Eq. 3 is linear in ∂L/∂ŵ = ∂L/∂w, and
        ŵ's R and s are the same for every micro-batch (key frozen, w unchanged): one pass
        per step equals the per-micro-batch sum (up to float summation order). ``w_grad``
        already averaged over data-parallel ranks gives the averaged ∂L/∂b_i."""
        amax = self.tile_amax(w, key, group)
        bits = self.bits(max_bits)
        scale = block_scale(amax, bits)  # amax: float32, float64 for a float64 w
        grad = bits_grad(w_grad, scale, self.layout, key, group)
        bits.backward(grad.to(bits.dtype))

    @torch.no_grad()
    def stats(self, max_bits: float | None = None) -> dict[str, float]:
        """Mean / min / max of b_t (clamped at ``max_bits`` when given) for the metrics."""
        b = self.bits(max_bits).float()
        return {"mean": b.mean().item(), "min": b.min().item(), "max": b.max().item()}


def bitwidth_loss(bits: list[torch.Tensor], b_target: float, lam: float,
                  count: int | None = None) -> torch.Tensor:
    """Eq. 10's extra term ``λ/n Σ |b_t - b_target|`` over the given b_t grids; ``count`` is
    n when these grids are only part of the model (default: their own element count)."""
    total = sum((b - b_target).abs().sum() for b in bits)
    n = count if count is not None else sum(b.numel() for b in bits)
    return lam / n * total


@torch.no_grad()
def grid_bits(weights: list[GaussWSWeight], bounds: list[float | None]):
    """b_t of each of ``weights`` (eq. 9) and b_t clamped at its bound (eq. 6; None: none),
    without autograd: two lists of grids, the same values as :meth:`GaussWSWeight.bits` in a
    few multi-tensor launches for all grids."""
    b_init, b_decay = weights[0].b_init, weights[0].b_decay
    bits = torch._foreach_add(torch._foreach_mul([w.b_i.detach() for w in weights],
                                                 b_init - b_decay), b_decay)
    return bits, torch._foreach_clamp_max(bits, [math.inf if b is None else b for b in bounds])


@torch.no_grad()
def bitwidth_loss_grads(weights: list[GaussWSWeight], bounds: list[float | None],
                        b_target: float, lam: float, count: int) -> list[torch.Tensor]:
    """∂/∂b_i of :func:`bitwidth_loss` over the ``weights``' clamped b_t (eq. 9, eq. 6 with
    ``bounds``; n = ``count``) without autograd: ``λ/n · sign(b_t - b_target) · (b_init -
    b_decay)`` where b_t is at most its bound, else 0 — autograd's values bit for bit, in a
    dozen multi-tensor (``_foreach``) launches for all grids instead of a dozen per grid."""
    if not weights:
        return []
    b_init, b_decay = weights[0].b_init, weights[0].b_decay
    bits, capped = grid_bits(weights, bounds)
    over = torch._foreach_sign(torch._foreach_sub(bits, capped))  # 1 above the bound, else 0
    grads = torch._foreach_sign(torch._foreach_sub(capped, b_target))  # |x|' = sign(x)
    torch._foreach_mul_(grads, torch._foreach_add(torch._foreach_neg(over), 1.0))
    torch._foreach_mul_(grads, lam / count)  # the order of autograd's products, so its bits
    torch._foreach_mul_(grads, b_init - b_decay)
    return grads
