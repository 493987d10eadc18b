"""GaussWS beneath the quantized linears: a b_i grid per sampled site, the operand transform
that hands the GEMM ŵ instead of w, and eq. 6's bound from the plan's weight formats.

One training step ``t`` of a sampled site ``L3.fc2`` (a megatron ``RowParallelLinear`` made
the platform's quantized linear):

* **forward** — the site's operand transforms run before its GEMM
  (``precision.layers.QuantizedLinear._forward_impl``); :meth:`SampledSites.transform` returns
  ``ŵ = w + R ⊙ s`` (eq. 1) from the local weight shard, the site's ``b_i`` (eq. 9, clamped
  at eq. 6's bound) and the step's key ``NoiseSeeds(seed).key("L3.fc2", t)``. The key
  is set once per step (:attr:`SampledSites.step`), so every micro-batch of the step — and a
  recomputed forward — samples the same ŵ (the paper's "virtual batch", §3.7). The plan then
  quantizes ŵ as the GEMM's weight operand (``module.formats.w``), like any weight. ŵ is
  handed over as a :class:`~megatron_ext.precision.gemm.RecomputableWeight`: the GEMM keeps
  w (the parameter), not ŵ nor its quantized copy.
* **backward** — the GEMM rebuilds ŵ from w, the tile scales and the key for dgrad (bit for
  bit: R is counter-based, the add deterministic); :class:`~.sampling.GaussSample` passes
  ∂L/∂ŵ to w unchanged (eq. 2) and computes ∂L/∂b_t (eq. 3) with the R of that rebuild.
  Nothing of R or ŵ is stored between the passes: the tile grid of s (0.004 byte per weight).
* **evaluation** — a module in ``eval()`` mode uses w: sampling is a training device.

Tensor parallelism: the site's :class:`~.layout.ShardLayout` places the local shard in the
full TP=1 weight (rows for column-parallel ``qkv`` / ``fc1``, two row ranges for the fused
SwiGLU ``fc1 = [gate; up]``; columns for row-parallel ``proj`` / ``fc2``). Tile maxima are
all-reduced (MAX) and the b_t gradient (SUM) over the layer's TP group, so ŵ is exactly the
TP=1 slice and the replicated ``b_i`` stays identical on every TP rank.

Eq. 6: ŵ is cast to the format the GEMMs read the weight in; a noise under half a grid step
of the tile's top binade is rounded away, so b_t is clamped at ``m + 2`` (``m`` = stored
mantissa bits) of the narrower of fprop's and dgrad's weight formats, read from
``module.formats`` on every call (a plan switch moves the bound at the next step). A site
with no plan passes ŵ through in the weight's own dtype (float32: 25, BF16: 9); an integer
weight format has no floating-point bound, so b_t is not clamped.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from megatron_ext.formats import CastElement, FloatElement, get_format
from megatron_ext.precision.layers import add_transform, quantized_linears
from megatron_ext.precision.site_formats import PASSTHROUGH, SiteFormats
from megatron_ext.sites import COLUMN_SITES, parse_site_id

from .flags import GaussWSConfig
from .layout import ShardLayout
from .noise import NoiseSeeds
from .sampling import format_mantissa_bits, underflow_bound
from .weight import GaussWSWeight, grid_bits

def site_layout(module, site: str, block: int) -> ShardLayout:
    """Where ``module``'s local weight lies in the full TP=1 weight of ``site``."""
    group = module.tp_group
    full = (module.output_size, module.input_size)
    if site in COLUMN_SITES:
        gated = site == "fc1" and module.config.gated_linear_unit
        return ShardLayout.tensor_parallel(full, group.size(), group.rank(), 0,
                                           2 if gated else 1, block)
    return ShardLayout.tensor_parallel(full, group.size(), group.rank(), 1, 1, block)


@lru_cache(maxsize=None)
def max_bits(formats: SiteFormats, dtype: torch.dtype) -> float | None:
    """Eq. 6's bound on b_t for a site with ``formats`` and weights of ``dtype`` (module
    docstring); None: no bound (an integer weight format)."""
    mantissas = []
    for name in {formats.operand("fprop", "w"), formats.operand("dgrad", "w")}:
        if name == PASSTHROUGH:
            mantissas.append(round(-math.log2(torch.finfo(dtype).eps)))  # eps = 2^-m
        elif isinstance(get_format(name).element, (FloatElement, CastElement)):
            mantissas.append(format_mantissa_bits(name))
        else:
            return None
    return float(underflow_bound(min(mantissas)))


class SampledSites:
    """This rank's sampled linears, their b_i grids and the step's noise keys."""

    def __init__(self, config: GaussWSConfig, seed: int):
        self.config = config
        """The run's settings (sites, eq. 9 constants, tile side)."""
        self.seeds = NoiseSeeds(seed)
        """Run seed -> site seed -> step key (§3.7); replaced by a checkpoint's on resume."""
        self.step = 1
        """The optimizer step being trained (1-based): its key is frozen over the step's
        micro-batches, and in force from the end of the step before (an observed pass made
        before the step samples what the step will)."""
        self.modules: dict[str, torch.nn.Module] = {}
        """Site id -> the quantized linear it samples (this rank's pipeline stage)."""
        self._lengths: tuple = (None, None)
        """(sites and device, their grids' sizes there) of the last :meth:`stats` call."""

    def attach(self, chunks) -> None:
        """Give every chosen site of ``chunks`` its ``b_i`` grid (submodule ``gaussws``:
        checkpointed with the layer, replicated over TP) and the sampling transform."""
        for sid, module in quantized_linears(chunks).items():
            site = parse_site_id(sid)[1]
            if site in self.config.sites:
                layout = site_layout(module, site, self.config.block)
                module.gaussws = GaussWSWeight(layout, self.config, module.weight.device)
                self.modules[sid] = module
        add_transform(chunks, list(self.modules), self.transform)

    def transform(self, module, input, weight):
        """The operand transform: (x, w) -> (x, ŵ) in training (ŵ recomputable: the GEMM
        keeps w and rebuilds ŵ in its backward), (x, w) in evaluation."""
        if not module.training:
            return input, weight
        group = module.tp_group if module.tp_group.size() > 1 else None
        key = self.seeds.key(module.site_id, self.step)
        bound = max_bits(module.formats, weight.dtype)
        return input, module.gaussws.sample(weight, key, bound, group)

    def bound(self, sid: str) -> float | None:
        """Eq. 6's bound on b_t of a site under its formats now (None: none)."""
        module = self.modules[sid]
        return max_bits(module.formats, module.weight.dtype)

    @torch.no_grad()
    def stats(self, sids: list[str]) -> torch.Tensor:
        """Mean, min and max of b_t as the GEMMs use it (clamped by eq. 6) per site of ``sids``
        (rows, float64, on the weights' device): one concatenation and three segment
        reductions for all sites, not a dozen launches per site."""
        weights = [self.modules[s].gaussws for s in sids]
        flat = torch.cat([b.reshape(-1) for b in grid_bits(
            weights, [self.bound(s) for s in sids])[1]]).double()
        key = (tuple(sids), flat.device)
        if self._lengths[0] != key:  # uploaded once per set of sites, not per logged step
            self._lengths = key, torch.tensor([w.b_i.numel() for w in weights], device=flat.device)
        lengths = self._lengths[1]
        return torch.stack([torch.segment_reduce(flat, op, lengths=lengths)
                            for op in ("mean", "min", "max")], dim=1)

    def bits(self, sid: str) -> torch.Tensor:
        """b_t of a site as its GEMMs use it now (eq. 9, clamped by eq. 6), with autograd."""
        return self.modules[sid].gaussws.bits(self.bound(sid))
