"""One SNIP refresh on every rank: steps 1-3 on a global batch, reduced statistics.

The refresh of step ``s`` observes the batch step ``s+1`` trains on, with the weights before
that step, three times through megatron's own pipeline schedule with every site's observer
attached (:mod:`megatron_ext.methods.snip.stats`), and no optimizer step:

1. ``base``: unquantized forward/backward, every statistic, the baseline gradients;
2. ``probe_backward``: the gradient of the last layer's output (the residual stream)
   replaced by noise;
3. ``probe_forward``: noise added to the input of the last layer's ``fc2``.

The passes need AdamW's state *after* step ``s+1`` (``A²``, :mod:`.adam`) to weight the
wgrad errors and probe gradients. Run before that step (as :mod:`.groundtruth` does), every
one of those N x K tensors is kept until it (six per site, float64). In training they run
**after** it instead, on the weights before it: :class:`WeightSnapshot` copies the weights
before step ``s+1`` and swaps them in for the passes; ``A²`` (float32) is then known, so each
site's tensors are weighted and freed in its own backward (bounded memory: ``docs/snip.md``).
The gradient buffers are zeroed afterwards and the torch RNG state is restored, so training
goes on exactly as it would have. :func:`reduce_statistics` then sums every rank's share
with one all-reduce of ``sites x stats`` float64 scalars; every rank ends up with the same
:class:`~megatron_ext.methods.snip.divergence.SiteStats` list, in global site order.

**Sites in groups** (``--snip-sites-per-pass N``). With several micro-batches a step every
observed site sums its ``dw`` and wgrad errors (float64, N x K) over the whole pass: at 70 B
on 64 GPUs that is 80 GiB per GPU. With ``N`` set, a rank's sites are observed ``N`` at a
time: the three passes run once per group, the other sites running the same unquantized
GEMMs (and the noise site its noise) without recording anything, so each site's
statistics come from the same operands as in one set of passes. Every rank runs the same
number of groups (the largest over the world: the pipeline runs all stages together).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_ext.precision.cost import ModelShape
from megatron_ext.precision.layers import quantized_linears
from megatron_ext.precision.observe import isolated_rng, observing
from megatron_ext.sites import SITES, parse_site_id, site_id
from megatron_ext.methods.snip.adam import adam_terms
from megatron_ext.methods.snip.divergence import SiteStats
from megatron_ext.methods.snip.probe_noise import entry_map
from megatron_ext.methods.snip.stats import (BASE, PER_FORMAT, PROBE_BACKWARD, PROBE_FORWARD, SCALARS,
                                     SiteObserver)
from megatron_ext.methods.snip.tensor_store import TensorStore
from megatron_ext.training.distributed import device

PASSES = (BASE, PROBE_BACKWARD, PROBE_FORWARD)


def _sample_offsets(args, consumed: int) -> list[int]:
    """Global index of the first sample of each of this DP rank's micro-batches."""
    dp, rank = (parallel_state.get_data_parallel_world_size(),
                parallel_state.get_data_parallel_rank())
    return [consumed + k * args.micro_batch_size * dp + rank * args.micro_batch_size
            for k in range(args.num_microbatches)]


def make_observers(model, candidates: dict, num_layers: int, noise_scale: float,
                   store: TensorStore | None = None) -> dict[str, SiteObserver]:
    """An observer on every local site (the last layer's fc2 carries the probe noise), each
    keeping its base gradient in ``store`` between passes (None: on the model's device)."""
    noise_site = site_id(num_layers - 1, "fc2")
    return {sid: SiteObserver(sid, module, candidates,
                              noise_scale if sid == noise_site else 0.0, store)
            for sid, module in quantized_linears(model).items()}


def _layer_hooks(model, observers: dict[str, SiteObserver], probe: str = "isotropic") -> list:
    """Each norm reports its gain κ² and its input's step-2 gradient to the site it feeds; the
    noise site's layer output gets the residual-stream probe (``probe``: ``--snip-probe``)."""
    handles = []
    for chunk in model:
        for layer in (m for m in chunk.modules() if isinstance(m, TransformerLayer)):
            for norm, linear in ((layer.input_layernorm, layer.self_attention.linear_qkv),
                                 (layer.pre_mlp_layernorm, layer.mlp.linear_fc1)):
                obs = observers.get(getattr(linear, "site_id", None))
                if obs is not None:
                    handles.append(norm.register_forward_hook(
                        lambda norm, inputs, _, obs=obs: obs.norm_forward(norm, inputs[0])))
            obs = observers.get(getattr(layer.mlp.linear_fc2, "site_id", None))
            if obs is not None and obs.noise_scale:
                obs.probe_map = _entry_map(layer) if probe == "dgrad" else None
                handles.append(layer.register_forward_hook(partial(_residual_probe, obs)))
    return handles


def _entry_map(layer: TransformerLayer) -> torch.Tensor:
    """The layer's ``qkv`` and ``fc1`` weights, scaled by their norms' ``γ``."""
    return entry_map([(layer.self_attention.linear_qkv.weight,
                       getattr(layer.input_layernorm, "weight", None)),
                      (layer.mlp.linear_fc1.weight,
                       getattr(layer.pre_mlp_layernorm, "weight", None))])


def _residual_probe(obs: SiteObserver, layer, inputs, output) -> None:
    hidden = output[0] if isinstance(output, tuple) else output
    if obs.mode == PROBE_BACKWARD and hidden.requires_grad:
        hidden.register_hook(obs.residual_probe)


def site_groups(sites: list[str], per_pass: int) -> list[list[str]]:
    """``sites`` (this rank's) in consecutive groups of ``per_pass`` (0: one group), as many
    groups as the rank with the most (a collective over the world; trailing ones empty)."""
    if not per_pass:
        return [sites]
    count = torch.tensor(-(-len(sites) // per_pass), device=device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return [sites[g * per_pass:(g + 1) * per_pass] for g in range(int(count))]


def collect(args, run, consumed_samples: int, candidates: dict, noise_scale: float,
            dataset=None, a2: dict | None = None, store: TensorStore | None = None,
            probe: str = "isotropic", sites_per_pass: int = 0
            ) -> tuple[dict[str, SiteObserver], float]:
    """Steps 1-3 on the batch at ``consumed_samples`` of ``dataset`` (default: training's)
    as observed passes through ``run.replay``, one isolated RNG stream for the three;
    returns (observers, base loss). With ``a2`` (:func:`adam_squares`) the A-weighted
    statistics are complete and no N x K tensor outlives its site's backward; ``store``: where
    the observers keep base gradients between passes (``--snip-offload``); ``probe``: the
    backward probe's noise (``--snip-probe``, :mod:`.probe_noise`); ``sites_per_pass``:
    observe the sites in groups of that many (module docstring; 0: all at once)."""
    observers = make_observers(run.model, candidates, args.num_layers, noise_scale, store)
    for sid, obs in observers.items():
        if a2 is not None and sid in a2:
            obs.adam_weighted(a2.pop(sid))
    handles = _layer_hooks(run.model, observers, probe)
    loss = float("nan")
    try:
        with (isolated_rng(args.seed + consumed_samples),
              observing(run.model, observers) as linears):
            for group in site_groups(list(observers), sites_per_pass):
                for sid, obs in observers.items():
                    obs.active = sid in group
                for mode in PASSES:
                    for obs in observers.values():
                        obs.begin_pass(mode, _sample_offsets(args, consumed_samples),
                                       args.micro_batch_size)
                    result = run.replay(consumed_samples, dataset)
                    loss = result if mode == BASE else loss
                    for sid, obs in observers.items():
                        obs.end_pass(linears[sid].weight)
    finally:
        for handle in handles:
            handle.remove()
    return observers, loss


def adam_squares(optimizer, model, store: TensorStore | None = None) -> tuple[dict, dict]:
    """After the normal step: (``A²`` of every local site's weight in float32, put in
    ``store`` (None: on the weight's device), the AdamW hyper-parameters), for
    :func:`collect`."""
    weights = {sid: m.weight for sid, m in quantized_linears(model).items()}
    return adam_terms(optimizer, weights, torch.float32, store)


class WeightSnapshot:
    """A copy of every parameter of ``model`` (its own dtype), taken now and put in
    :attr:`store`; :meth:`swapped` puts it in place for a block and the current values back
    after, one parameter at a time (on disk, never two whole copies in memory)."""

    def __init__(self, model, store: TensorStore | None = None):
        self.store = store or TensorStore()
        """Where the copy waits (``--snip-offload``; default: the model's device)."""
        self.params = [p for chunk in model for p in chunk.parameters()]
        self.saved = [self.store.put(p.detach(), copy=True) for p in self.params]

    def _swap(self) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                current = self.store.put(p.detach(), copy=True)
                p.copy_(self.saved[i].get(p.device))
                self.saved[i].free()
                self.saved[i] = current

    @contextmanager
    def swapped(self):
        self._swap()
        try:
            yield
        finally:
            self._swap()


def adam_statistics(optimizer, model, observers: dict[str, SiteObserver]) -> dict:
    """After the normal step: feed AdamW's ``A²`` to every observer; returns the
    hyper-parameters (lr, betas, step, eps)."""
    weights = {sid: m.weight for sid, m in quantized_linears(model).items()}
    a2, hyper = adam_terms(optimizer, weights)
    for sid, obs in observers.items():
        if sid in a2:
            obs.adam_weighted(a2[sid])
    return hyper


def _layout(candidates: dict) -> list[tuple[str, str | None]]:
    """Column order of the flat statistics vector of one site."""
    cols = [(key, None) for key in SCALARS]
    return cols + [(key, f) for key, role in PER_FORMAT.items() for f in candidates[role]]


def reduce_statistics(observers: dict[str, SiteObserver], args, candidates: dict
                      ) -> list[SiteStats]:
    """Sum every rank's shares (one all-reduce) into the global per-site statistics."""
    sites = [site_id(layer, s) for layer in range(args.num_layers) for s in SITES]
    cols = _layout(candidates)
    zero = torch.zeros((), dtype=torch.float64, device=device())
    values = [zero] * (len(sites) * len(cols))  # 0-dim float64 scalars, on the device
    for i, sid in enumerate(sites):
        if sid not in observers:  # a site of another pipeline stage: zeros
            continue
        stats = observers[sid].stats
        for c, (key, fmt) in enumerate(cols):
            value = stats[key] if fmt is None else stats[key][fmt]
            if torch.is_tensor(value):  # a statistic no pass added to stays the float 0.0
                # (A²'s sum is made where A² is kept: on the host with --snip-offload host)
                values[i * len(cols) + c] = value.to(zero.device)
    flat = torch.stack(values).view(len(sites), len(cols))
    dist.all_reduce(flat)
    flat = flat.cpu()  # the refresh's one read of its statistics
    shape = ModelShape.from_args(args)
    out = []
    for i, sid in enumerate(sites):
        stats: dict = {key: {} for key in PER_FORMAT}
        for c, (key, fmt) in enumerate(cols):
            if fmt is None:
                stats[key] = float(flat[i, c])
            else:
                stats[key][fmt] = float(flat[i, c])
        n, k = shape.site_nk(parse_site_id(sid)[1])
        out.append(SiteStats(sid, n, k, stats))
    return out
