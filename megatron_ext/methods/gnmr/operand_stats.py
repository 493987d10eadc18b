"""Quantization statistics of every low-precision GEMM operand, for ``--gnmr-rule autoswitch``.

Transformer Engine's ``AutoswitchGemm`` judges a quantized tensor ``t`` by two numbers, taken
from its dequantized copy ``q = q(t)``::

    underflow % = 100 · #{ t != 0  and  q == 0 } / numel(t)     (elements flushed to zero)
    MSE         = Σ (t - q)^2 / numel(t)                          (not normalised)

and switches a GEMM to high precision when either crosses its threshold. Here they are taken
for the six operands of every site's three GEMMs (:class:`~megatron_ext.precision.site_formats.
GemmOperands`: fprop's x and w, dgrad's dy and w, wgrad's dy and x, each along its own
reduction axis as :mod:`megatron_ext.precision.gemm` quantizes it), in the site's **base
plan** formats — the low precision a promotion would replace, whatever the site ran in this
step, so a promoted unit keeps being judged. Passthrough operands are not monitored.

**When.** A forward hook on each quantized linear sees ``x`` and the weight; a tensor hook on
its output sees ``dy`` in the backward. Hooks do nothing under ``no_grad`` (evaluation) or
during an observed pass (SNIP / PGQ replays). The operands are quantized again for the
statistics (the GEMM's own quantization is not exposed), with a private generator seeded
from the iteration for stochastic-rounding formats, so training's random stream is untouched
and a resumed run measures the same numbers.

**Reduction.** Per site and operand the hooks add up, in float64 on the device, four sums:
underflow count, squared error, square of ``t`` and element count, over every micro-batch of
the step (and every TP shard / DP replica / PP stage, through one all-reduce of a
``sites x 6 x 4`` vector). So a step's statistic is pooled over the global batch, and every
rank takes the same decision — unlike TE, where each rank decides from its local tensors
per GEMM call. With sequence parallelism the hooks see a rank's sequence shard of ``x`` and
of a row-parallel layer's ``dy`` (megatron gathers them inside the layer): per-tensor
scales then come from the shard.

:func:`unit_stats` turns the sums into :class:`~.rules.OperandStats`, the largest
underflow %, MSE and relative MSE (MSE over the mean square of ``t``) over each unit's
monitored operands — TE's OR over the tensors of a GEMM, widened to the unit.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.formats import Format, error_sums, fake_quant
from megatron_ext.formats.error import SUMS as ERROR_SUMS
from megatron_ext.methods.gnmr.rules import OperandStats
from megatron_ext.methods.gnmr.units import unit_of_site
from megatron_ext.precision.layers import quantized_linears
from megatron_ext.precision.site_formats import resolve
from megatron_ext.sites import OPERANDS
from megatron_ext.training.distributed import device

SUMS = (*ERROR_SUMS, "numel")
"""The four sums kept per site and operand (module docstring)."""


def operand_sums(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[underflow count, Σ (t-q)^2, Σ t^2, numel]`` of ``t`` and its dequantized ``q``
    (float64, on ``t``'s device; the first three from :func:`~megatron_ext.formats.error_sums`,
    one Triton pass on a GPU)."""
    sums = error_sums(t, q)
    return torch.cat([sums, sums.new_full((1,), float(t.numel()))])  # filled on the device


def unit_stats(sums: np.ndarray, sites: Sequence[str], units: Sequence[str],
               granularity: str) -> OperandStats:
    """Per unit, the worst operand of its sites; ``sums`` is ``(len(sites), 6, 4)``."""
    cnt, err, sq, numel = (sums[..., i] for i in range(len(SUMS)))
    seen = numel > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        pct = np.where(seen, 100.0 * cnt / numel, 0.0)
        mse = np.where(seen, err / numel, 0.0)
        rel = np.where(sq > 0, err / sq, np.where(err > 0, np.inf, 0.0))
    index = {u: i for i, u in enumerate(units)}
    out = np.zeros((3, len(units)))
    for s, sid in enumerate(sites):
        u = index[unit_of_site(sid, granularity)]
        for row, value in enumerate((pct[s], mse[s], rel[s])):
            out[row, u] = np.max([out[row, u], *value])  # keeps a NaN
    return OperandStats(*out)


class OperandStatsCollector:
    """Hooks on a model's quantized linears that sum the statistics of one step."""

    def __init__(self, plans, sites: Sequence[str], units: Sequence[str], granularity: str):
        self.plans = plans
        """The plan controller (its *base* plan gives the monitored formats)."""
        self.sites = tuple(sites)
        """Every site id of the model, in the order of the reduced vector."""
        self.units, self.granularity = tuple(units), granularity
        """The run's units and how sites map to them."""
        self.sums: dict[str, torch.Tensor] = {}
        """Site id -> its ``(6, 4)`` float64 sums so far in this step."""
        self.generator: torch.Generator | None = None
        """Draws the stochastic-rounding formats' randomness (seeded per step), on the CPU:
        a Triton quantizer takes one seed per call from it, which a CUDA generator would
        make a host read each (on CPU tensors the same stream as before)."""
        self.seed = 0
        """This step's seed (the iteration)."""

    def attach(self, model) -> None:
        for sid, module in quantized_linears(model).items():
            module.register_forward_hook(partial(self._forward, sid), with_kwargs=True)

    def reset(self, seed: int) -> None:
        """Start a step: drop what evaluation or a replay may have left, reseed."""
        self.sums, self.seed, self.generator = {}, seed, None

    def _operands(self, sid: str):
        base = self.plans.base
        return resolve(base.formats(sid)) if base is not None else None

    def _add(self, sid: str, index: int, t: torch.Tensor, fmt: Format | None,
             axis: int) -> None:
        if fmt is None:
            return
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.seed)  # host-side draws
        with torch.no_grad():
            q = fake_quant(t.detach(), fmt, axis=axis, generator=self.generator)
            sums = operand_sums(t.detach(), q)
        if sid not in self.sums:
            self.sums[sid] = torch.zeros(len(OPERANDS), len(SUMS), dtype=torch.float64,
                                         device=t.device)
        self.sums[sid][index] += sums

    def _forward(self, sid, module, args, kwargs, output) -> None:
        if module.observer is not None or not torch.is_grad_enabled():
            return
        ops = self._operands(sid)
        if ops is None or ops.passthrough:
            return
        x = args[0] if args else kwargs["input_"]
        x2, w = x.reshape(-1, x.shape[-1]), module.weight
        for name, t, axis in (("fprop.x", x, -1), ("fprop.w", w, 1), ("dgrad.w", w.t(), -1),
                              ("wgrad.x", x2.t(), -1)):
            self._add(sid, OPERANDS.index(name), t, getattr(ops, name.replace(".", "_")),
                      axis)
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(partial(self._backward, sid, ops))

    def _backward(self, sid, ops, dy: torch.Tensor) -> None:
        dy2 = dy.reshape(-1, dy.shape[-1])
        self._add(sid, OPERANDS.index("dgrad.dy"), dy, ops.dgrad_dy, -1)
        self._add(sid, OPERANDS.index("wgrad.dy"), dy2.t(), ops.wgrad_dy, -1)

    def reduce(self) -> OperandStats:
        """This step's per-unit statistics, identical on every rank (one all-reduce)."""
        vector = torch.zeros(len(self.sites), len(OPERANDS), len(SUMS), dtype=torch.float64,
                             device=device())
        for s, sid in enumerate(self.sites):
            if sid in self.sums:
                vector[s] = self.sums[sid].to(vector.device)
        dist.all_reduce(vector)
        return unit_stats(vector.cpu().numpy(), self.sites, self.units, self.granularity)
