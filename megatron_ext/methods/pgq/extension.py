"""``--precision pgq`` in training: profile at start-up, then train with the recipe's plan.

**When the profile runs.** It needs the model with the weights training continues from and
the batches it will train on, so the policy's ``make(args, arg)`` returns a safe plan
(``pgq:safe``: nothing quantized) and the recipe replaces the base plan in ``before_step`` of
the first step this process trains — after ``--load``, which ``after_setup`` would precede
(a fine-tuned or resumed model is profiled with its loaded weights, not its random init), on
the ``--pgq-profile-steps`` batches training consumes next. The platform's ``commit_step``
phase follows every ``before_step`` and commits the recipe, so the very first step already
runs it; the profile's time is reported as ``pgq_profile_s`` in that step's metrics, outside
``step_time_s``, and its last batch's as ``pgq_profile_last_batch_s`` (on a GPU the first
batch also compiles the Triton kernels it uses first). Nothing stays attached: every other
step runs without overhead.

With ``--pgq-profile-start N`` the first N steps train under the safe plan and the profile
is taken before step N+1 (after the early transient: at random init every site looks alike).
With ``--pgq-logits`` a recipe that quantizes a logits GEMM installs its formats on the
output layer (:mod:`.logits`), next to the plan.

The profile is checkpoint state (``pgq``: the step it was taken at, and the output layer's
formats): a resumed run keeps the checkpoint's recipe (the plan controller's base plan, the
logits formats) and does not profile again. With
``--pgq-profile FILE`` the recipe is made from a saved profile in ``make`` itself, so
``--dry-run`` sees it too and no profile is taken.

Rank 0 writes ``<run>/pgq/profile.json``, ``recipe.md`` and ``recipe.json`` and prints the
recipe's summary; every rank installs rank 0's plan (a broadcast), which the platform then
hash-checks on every rank.
"""

from __future__ import annotations

import argparse
import os
import time

import torch.distributed as dist

from megatron_ext.extension import Extension
from megatron_ext.io import write_json_atomic
from megatron_ext.methods.pgq.logits import quantize_logits
from megatron_ext.methods.pgq.observe import collect_profile
from megatron_ext.methods.pgq.flags import (POLICY, PgqConfig, active, add_profile_arguments,
                                            add_recipe_arguments, config_from_args)
from megatron_ext.methods.pgq.plots import PLOTS
from megatron_ext.methods.pgq.profile import load_profile
from megatron_ext.methods.pgq.recipe import make_recipe
from megatron_ext.methods.pgq.report import summary, write_recipe
from megatron_ext.precision import device_profile
from megatron_ext.precision.controller import PlanController
from megatron_ext.precision.cost import ModelShape
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.policies import Policy
from megatron_ext.precision.site_formats import SiteFormats

SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "swiglu")
"""What a saved profile must share with the run it makes a recipe for."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("PGQ (--precision pgq): profile-guided per-GEMM recipes")
    add_profile_arguments(g)
    add_recipe_arguments(g)


def saved_recipe(config: PgqConfig, shape: ModelShape):
    """The recipe of ``--pgq-profile`` for this run's settings and model ``shape``;
    ``ValueError`` if the profile is of another model or lacks the format."""
    profile = load_profile(config.profile)
    other = [f for f in SHAPE_FIELDS if profile.model.get(f) != getattr(shape, f)]
    if other:
        raise ValueError(f"'{config.profile}' profiles another model ({', '.join(other)} "
                         "differ)")
    return make_recipe(profile, config.recipe, _device(config))


def _device(config: PgqConfig):
    """The run's device profile (``--device-profile``), for the recipe's estimated time."""
    return device_profile.resolve(config.device_profile)


def pgq_plan(config: PgqConfig, shape: ModelShape) -> PrecisionPlan:
    """The policy's base plan: the saved profile's recipe, else the safe plan."""
    if config.profile:
        return saved_recipe(config, shape).plan
    return PrecisionPlan({}, method=f"{POLICY}:safe")


class PgqRun:
    """One run's PGQ state."""

    def __init__(self, controller: PlanController):
        self.controller = controller
        """The platform's plan controller: the recipe replaces its base plan."""
        self.config: PgqConfig | None = None
        """The settings (None: PGQ is off), built once from the flags."""
        self.args = None
        """The flags the config was built from (the run's model shape and run directory;
        PGQ's own come from ``config``)."""
        self.profiled_at: int | None = None
        """The step the profile was taken before (None: not yet)."""
        self.logits: dict | None = None
        """The output layer's formats (``SiteFormats.to_dict``), None: megatron's GEMM."""
        self._profile_s: float | None = None
        self._batch_s: list[float] = []
        self._logits_installed = False

    def configure(self, args) -> PgqConfig | None:
        """Build the config from the flags once (``validate``, or the policy's ``make`` if
        the platform asks first)."""
        if self.args is not args:
            self.config, self.args = config_from_args(args), args
        return self.config

    def validate(self, args) -> None:
        self.configure(args)

    def make_plan(self, args, arg=None) -> PrecisionPlan:
        """The policy's ``make``: :func:`pgq_plan` under this run's config."""
        return pgq_plan(self.configure(args), ModelShape.from_args(args))

    def after_setup(self, args, run, state) -> None:
        run.checkpointer.register(POLICY, self)
        if self.config.profile:
            recipe = saved_recipe(self.config, ModelShape.from_args(args))
            self.logits = None if recipe.logits is None else recipe.logits.to_dict()
            if dist.get_rank() == 0:
                write_recipe(recipe, os.path.join(args.run_dir, POLICY))
                print(f"pgq: {summary(recipe)} (from '{self.config.profile}')", flush=True)

    def before_step(self, args, run, state) -> None:
        config = self.config
        if config.profile or self.profiled_at is not None:
            if self.logits is not None and not self._logits_installed:
                quantize_logits(run.model, SiteFormats.from_dict(self.logits))
                self._logits_installed = True
            return
        if state.iteration < config.profile_start:
            return
        start, self._batch_s = time.perf_counter(), []
        profile = collect_profile(args, run, state, config.profile_steps, config.candidates,
                                  self._batch_s)
        recipe = make_recipe(profile, config.recipe, _device(config))
        payload = [None]
        if dist.get_rank() == 0:
            out = os.path.join(args.run_dir, POLICY)
            os.makedirs(out, exist_ok=True)
            write_json_atomic(os.path.join(out, "profile.json"), profile.to_dict())
            write_recipe(recipe, out)
            payload[0] = (recipe.plan.to_dict(),
                          None if recipe.logits is None else recipe.logits.to_dict())
            print(f"pgq: profiled {len(profile.gemms)} GEMMs on {profile.steps} batch(es) in "
                  f"{time.perf_counter() - start:.1f} s; {summary(recipe)}; {out}", flush=True)
        dist.broadcast_object_list(payload, src=0)
        plan, self.logits = payload[0]
        self.controller.set_base(PrecisionPlan.from_dict(plan))
        if self.logits is not None:
            quantize_logits(run.model, SiteFormats.from_dict(self.logits))
        self._logits_installed = True
        self.profiled_at = state.iteration
        self._profile_s = time.perf_counter() - start

    def on_step(self, args, run, state) -> dict | None:
        if self._profile_s is None:
            return None
        seconds, self._profile_s = self._profile_s, None
        return {"pgq_profile_s": seconds, "pgq_profile_last_batch_s": self._batch_s[-1]}

    def state_dict(self) -> dict:
        return {"profiled_at": self.profiled_at, "logits": self.logits}

    def load_state_dict(self, state: dict) -> None:
        self.profiled_at = state.get("profiled_at")
        self.logits = state.get("logits")  # installed by the next before_step
        self._logits_installed = False


def describe(pgq: PgqConfig) -> str:
    """The start-up line of ``--precision pgq``: the recipe settings and the profile."""
    config = pgq.recipe
    budget = f", budget {config.budget:g} of the linear FLOPs" if config.budget else ""
    mode = "" if config.mode == "recipe" else f" | validation recipe: {config.mode}"
    source = (f"profile from '{pgq.profile}'" if pgq.profile else
              f"profiles {pgq.profile_steps} batch(es) before step "
              f"{pgq.profile_start + 1} in {','.join(pgq.candidates)}")
    return (f"pgq: on | format {config.format} where SQNR >= {config.fwd_threshold:g} (fprop) /"
            f" {config.bwd_threshold:g} (dgrad, wgrad), roofline {config.device}{budget}{mode}"
            f" | {source}")


def pgq_extension(controller: PlanController) -> Extension:
    """The PGQ Extension of one run; its recipe replaces ``controller``'s base plan."""
    pgq = PgqRun(controller)
    policy = Policy(POLICY, pgq.make_plan, owner=POLICY,
                    help="PGQ: per-GEMM recipe from a start-up SQNR profile")

    def when_on(hook):
        return lambda args, *rest: hook(args, *rest) if pgq.config is not None else None

    return Extension(name=POLICY, add_arguments=add_arguments, validate=pgq.validate,
                     describe=when_on(lambda args: describe(pgq.config)),
                     active=active, enabled_by=f"--precision {POLICY}", policies=(policy,),
                     plots=PLOTS, conflicts=PgqConfig.CONFLICTS,
                     after_setup=when_on(pgq.after_setup),
                     before_step=when_on(pgq.before_step), on_step=when_on(pgq.on_step))
