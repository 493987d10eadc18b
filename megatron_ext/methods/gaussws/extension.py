"""``--gaussws`` in training: b_i parameters, the sampling transform, eq. 10, metrics, state.

Hooks, in the order a run calls them (``default_extensions()``):

1. ``validate`` reads the flags (:class:`.config.GaussWSConfig`) and asks the precision
   platform for its quantized linears even without ``--precision`` (the transform lives in
   them; with no plan they pass their operands through, i.e. they are megatron's linears);
2. ``after_model`` — the model is built, before DDP and the optimizer: every chosen site gets
   its ``b_i`` grid and the transform (:meth:`.attach.SampledSites.attach`). ``b_i`` is an
   ordinary parameter from here on: DDP reduces its gradient over data-parallel ranks, the
   optimizer updates it with weight decay (pulling b_t towards b_target_decay, eq. 9), the gradient
   norm counts it once (no ``tensor_model_parallel`` attribute: a TP duplicate), and the
   checkpoint holds it with the layer (``...linear_fc2.gaussws.b_i``, replicated over TP);
3. ``wrap_optimizer`` — with ``--gaussws-lambda`` > 0, ``optimizer.step`` first adds eq. 10's
   gradient ``∂/∂b_i (λ/n Σ|b_t - b_target_loss|)`` to the reduced b_i gradients (n: every tile of
   every sampled weight, model-wide; each pipeline stage adds its own tiles' terms);
4. ``after_setup`` registers the checkpoint state ``gaussws`` (the run seed and the settings);
5. ``before_step`` (and already ``on_step`` of the step before, for observed passes made
   between steps) sets the step whose key every micro-batch of the step samples with;
6. ``on_step`` adds ``gaussws_b_{mean,min,max}/<site id>`` (b_t as the GEMMs use it, clamped
   by eq. 6) for every sampled site of the model (gathered over pipeline stages), on the
   steps that are logged.

Resume: the keys depend only on (run seed, site id, step); the step comes back with the
iteration, the run seed from the checkpoint (a resume under another ``--seed`` keeps sampling
the original run's noise), and ``b_i`` with the model, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext.errors import UsageError
from megatron_ext.extension import Extension
from megatron_ext.precision.controller import PlanController
from megatron_ext.sites import site_id
from megatron_ext.training.distributed import device

from .attach import SampledSites
from .flags import GaussWSConfig, active, add_arguments
from .noise import NoiseSeeds
from .plots import PLOTS
from .weight import bitwidth_loss_grads

OWNER = "gaussws"
"""Name of the extension and of its checkpoint state."""
STATS = ("mean", "min", "max")
"""Per-site b_t statistics in the metrics."""


class GaussWSRun:
    """One run's GaussWS: settings, the sampled sites of this rank, the model-wide tile count."""

    def __init__(self, plans: PlanController):
        self.plans = plans
        """The platform's plan controller (asked for the quantized linears)."""
        self.config: GaussWSConfig | None = None
        """The settings (None: ``--gaussws`` is off)."""
        self.sampled: SampledSites | None = None
        """This rank's sampled linears and the step keys."""
        self.site_ids: list[str] = []
        """Every sampled site of the model (all stages), in plan order."""
        self.tiles = 0
        """Tiles of all sampled weights of the model (eq. 10's n)."""

    def validate(self, args) -> None:
        self.config = GaussWSConfig.from_args(args)
        if not self.config.enabled:
            self.config = None
            return
        self.plans.require_linears(OWNER)
        self.site_ids = [site_id(layer, s) for layer in range(args.num_layers)
                         for s in self.config.sites]

    def after_model(self, args, chunks) -> None:
        if self.config is None:
            return
        self.sampled = SampledSites(self.config, args.seed)
        self.sampled.attach(chunks)
        local = sum(m.gaussws.b_i.numel() for m in self.sampled.modules.values())
        self.tiles = int(_pipeline_sum(torch.tensor([float(local)], dtype=torch.float64))[0])

    def wrap_optimizer(self, args, model, optimizer):
        if self.config is None or self.config.lam == 0:
            return optimizer
        step = optimizer.step

        def step_with_bitwidth_loss(*a, **kw):
            self._add_bitwidth_loss_grad(optimizer)
            return step(*a, **kw)

        optimizer.step = step_with_bitwidth_loss
        return optimizer

    def _add_bitwidth_loss_grad(self, optimizer) -> None:
        """Eq. 10's gradient into the b_i gradient buffers (scaled like the loss's)."""
        sids = list(self.sampled.modules)
        if not sids:
            return
        weights = [self.sampled.modules[s].gaussws for s in sids]
        bounds = [self.sampled.bound(s) for s in sids]
        grads = bitwidth_loss_grads(weights, bounds, self.config.b_target_loss, self.config.lam,
                                    self.tiles)
        targets = [w.b_i.main_grad if hasattr(w.b_i, "main_grad") else w.b_i.grad
                   for w in weights]
        # the loss scale: a device tensor (no host synchronisation), of shape (1,) in megatron
        scale = optimizer.get_loss_scale().to(targets[0].dtype).reshape(())
        grads = [g.to(t.dtype) for g, t in zip(grads, targets)]
        torch._foreach_add_(targets, torch._foreach_mul(grads, scale))

    def after_setup(self, args, run, state) -> None:
        if self.config is not None:
            run.checkpointer.register(OWNER, self)

    def before_step(self, args, run, state) -> None:
        if self.sampled is not None:
            self.sampled.step = state.iteration + 1

    def on_step(self, args, run, state) -> dict | None:
        if self.config is None:
            return None
        self.sampled.step = state.iteration + 1
        if not run.step_result["logged"]:  # the statistics cost launches and a copy
            return None
        stats = torch.zeros(len(self.site_ids), len(STATS), dtype=torch.float64)
        rows = [row for row, sid in enumerate(self.site_ids) if sid in self.sampled.modules]
        if rows:  # one copy to the host for all sites, not a synchronisation per site
            stats[rows] = self.sampled.stats([self.site_ids[row] for row in rows]).cpu()
        stats = _pipeline_sum(stats).tolist()  # each site lives on one stage: the sum gathers
        return {f"gaussws_b_{name}/{sid}": stats[row][col]
                for row, sid in enumerate(self.site_ids) for col, name in enumerate(STATS)}

    # -- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        c = self.config
        return {"run_seed": self.sampled.seeds.run_seed, "sites": list(c.sites),
                "block": c.block, "b_init": c.b_init, "b_target_decay": c.b_target_decay}

    def load_state_dict(self, state: dict) -> None:
        c = self.config
        # checkpoints written before eq. 9 / eq. 10 targets were separate call eq. 9's "b_target"
        decay = state.get("b_target_decay", state.get("b_target"))
        saved = (tuple(state["sites"]), state["block"], state["b_init"], decay)
        if saved != (c.sites, c.block, c.b_init, c.b_target_decay):
            raise UsageError(f"--load: the checkpoint's GaussWS (sites {saved[0]}, block "
                             f"{saved[1]}, b_init {saved[2]}, b_target_decay {saved[3]}) differs "
                             "from the flags'")
        self.sampled.seeds = NoiseSeeds(state["run_seed"])


def _pipeline_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over this rank's pipeline-parallel group (a no-op without PP)."""
    group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) > 1:
        t = t.to(device())  # where the backend reduces (NCCL: the GPU)
        dist.all_reduce(t, group=group)
        t = t.cpu()
    return t


def describe(config: GaussWSConfig) -> str:
    """The start-up line of ``--gaussws``."""
    loss = (f"bit-width loss lambda {config.lam:g} towards {config.b_target_loss:g} bits"
            if config.lam else "no bit-width loss")
    return (f"gaussws: on | sampled weights of {','.join(config.sites)} | learnable bit width "
            f"per {config.block}x{config.block} tile from {config.b_init:g} bits, weight decay "
            f"towards {config.b_target_decay:g} | {loss}")


def gaussws_extension(plans: PlanController) -> Extension:
    """The GaussWS Extension of one run (``--gaussws``); ``plans`` gives it quantized linears."""
    run = GaussWSRun(plans)
    return Extension(name=OWNER, add_arguments=add_arguments, validate=run.validate,
                     describe=lambda args: describe(run.config) if run.config else None,
                     active=active, enabled_by="--gaussws SITES",
                     plots=PLOTS, conflicts=GaussWSConfig.CONFLICTS,
                     after_model=run.after_model, wrap_optimizer=run.wrap_optimizer,
                     after_setup=run.after_setup, before_step=run.before_step,
                     on_step=run.on_step)
