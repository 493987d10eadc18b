"""``--precision snip`` (and the §6.1 baselines) in training: flags, schedule, worker, plans.

Schedule (SNIP §3, Fig. 6). With ``--snip-start S --snip-interval I --snip-apply-lag D``,
a **refresh** happens before steps ``s = S, S+I, S+2I, ...`` (``s`` = optimizer steps done):

1. every rank copies its weights (:class:`~megatron_ext.methods.snip.refresh.WeightSnapshot`)
   and trains step ``s+1`` normally;
2. after that step it reads the AdamW terms, swaps the copy in and runs steps 1-3 on the batch
   step ``s+1`` trained on (:func:`megatron_ext.methods.snip.refresh.collect`: the statistics
   of the weights before the step, A-weighted as they complete), swaps the weights back, and
   all statistics are summed over all ranks (one all-reduce of ``sites x stats`` scalars);
3. rank 0 runs step 4 (divergences) and 5 (ILP) in a background thread while training goes
   on, and writes ``<run dir>/snip/step_<s>/{stats,divergence,problem,solution,plan}.json``;
4. before step ``s + D + 1`` (after ``D`` steps) every rank takes the plan from rank 0
   (waiting there if the worker is not done: a step fixed in advance, never a race),
   applies it and checks that all ranks hold the same plan hash.

The pending refresh (its reduced statistics and apply step) is checkpoint state: resuming
between ``s`` and ``s+D`` re-solves from the saved statistics and applies the same plan at
the same step. Until the first plan the run uses the **safe plan** — the first candidate
for every role (FP8 by default). ``random``, ``e-layer-type`` and ``e-layer-id`` need no
statistics: their plan is solved once at start-up.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch.distributed as dist

from megatron_ext.precision.controller import PlanController
from megatron_ext.precision import device_profile
from megatron_ext.precision.cost import ModelShape, stage_fixed_seconds
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.policies import Policy
from megatron_ext.sites import SITES, ROLES, site_id
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.methods.snip import dry_run, memory, planner
from megatron_ext.methods.snip.divergence import SiteStats, divergences
from megatron_ext.methods.snip.flags import (ENABLED_BY, POLICIES, SnipConfig, active,
                                             add_arguments, config_from_args)
from megatron_ext.methods.snip.candidates import option_name
from megatron_ext.methods.snip.plots import PLOTS
from megatron_ext.io import write_json_atomic
from megatron_ext.methods.snip.refresh import (WeightSnapshot, adam_squares, collect,
                                               reduce_statistics)
from megatron_ext.methods.snip.tensor_store import TensorStore, resolve
from megatron_ext.extension import Extension
from megatron_ext.training.distributed import device

def initial_plan(config: SnipConfig, args) -> PrecisionPlan:
    """The base plan before the first refresh (the policies' ``make``): the static
    baselines' ILP plan, else the **safe plan** (every role's first candidate)."""
    if not config.refreshes:
        return solve_plan(config, args, config.policy, None, step=0)[0]
    first = SiteFormats(*(config.candidates[r][0] for r in ROLES))
    sites = {site_id(layer, s): first for layer in range(args.num_layers) for s in SITES}
    return PrecisionPlan(sites, method=f"{config.policy}:safe")


def solve_plan(config: SnipConfig, args, policy: str, stats, step, loss=1.0, hyper=None,
               warm=None):
    """Steps 4-5: quality table -> ILP -> plan; returns (plan, solution, q, table, problem)
    (``table``: ΔL, ΔW, Q per site x option, ``snip`` only, kept for divergence.json)."""
    shape = ModelShape.from_args(args)
    sites = [site_id(layer, s) for layer in range(args.num_layers) for s in SITES]
    options = list(config.options)
    table = None
    if policy == "snip":
        table = divergences(stats, options, loss, hyper, *config.weights)
        q = planner.divergence_q(table)
    else:
        q = planner.quality_table(policy, stats, options, loss, hyper, shape, config.seed,
                                  config.weights)
    profile = device_profile.resolve(getattr(args, "device_profile", None))
    fixed = stage_fixed_seconds(shape, profile=profile)
    problem = planner.build_problem(sites, options, q, shape, fixed,
                                    meta={"step": step, "policy": policy,
                                          "device_profile": profile.name}, profile=profile)
    plan, solution = planner.make_plan(problem, options, policy, step, config.budget,
                                       config.stage_balance, config.solver, warm)
    return plan, solution, q, table, problem


class SnipRun:
    """One run's SNIP state: options, the pending refresh, the worker."""

    def __init__(self, controller: PlanController):
        self.controller = controller
        """The platform's plan controller: a refresh replaces its base plan."""
        self.config: SnipConfig | None = None
        """The settings (None: SNIP is off), built once from the flags."""
        self.args = None
        """The run's flags (model shape, run dir; SNIP's own come from ``config``)."""
        self.pending: dict | None = None
        """The refresh awaiting its apply step: step, apply, stats, loss, hyper."""
        self._snapshot = None
        """(WeightSnapshot, consumed samples) of a refresh due, from before its step ``s+1``
        until its passes after that step."""
        self._worker: threading.Thread | None = None
        self._result: dict | None = None
        self._apply_s: float | None = None

    def configure(self, args) -> SnipConfig | None:
        """Build the config from the flags once (``validate``, or the policy's ``make`` if
        the platform asks first)."""
        if self.args is not args:
            self.config, self.args = config_from_args(args), args
        return self.config

    def validate(self, args) -> None:
        self.configure(args)

    def make_plan(self, args, arg=None) -> PrecisionPlan:
        """The policies' ``make``: :func:`initial_plan` under this run's config."""
        return initial_plan(self.configure(args), args)

    def stand_in_plan(self, args, shape) -> PrecisionPlan:
        """The statistics policies' ``dry_run``: the ILP plan of this shape."""
        return dry_run.stand_in_plan(self.configure(args), args, shape)

    def after_setup(self, args, run, state) -> None:
        run.checkpointer.register("snip", self)
        if self.config.refreshes:  # before the first step: would a refresh fit?
            memory.check_fits(memory.of_run(args, run.model, self.config.candidates,
                                            self._offload(), self.config.sites_per_pass),
                              _activations(args))

    def _offload(self) -> str:
        """Where a refresh keeps its snapshot, ``A²`` and base gradients: ``--snip-offload``
        with ``auto`` resolved on this run's device (host, disk or none)."""
        return resolve(self.config.offload, device().type)

    # -- schedule ----------------------------------------------------------------------
    def _refresh_due(self, step: int) -> bool:
        c = self.config
        if not c.refreshes or step < c.start:
            return False
        if step == c.start:
            return True
        return bool(c.interval) and (step - c.start) % c.interval == 0

    def before_step(self, args, run, state) -> None:
        if self.pending is not None and state.iteration == self.pending["apply"]:
            start = time.perf_counter()
            self._apply()
            self._apply_s = time.perf_counter() - start
        if self._refresh_due(state.iteration):  # the passes run after the step
            store = TensorStore.for_offload(self._offload(), args.run_dir)
            self._snapshot = (WeightSnapshot(run.model, store), state.consumed_samples)

    def on_step(self, args, run, state) -> dict | None:
        """Metrics of this step: ``snip_apply_s`` (plan switch before it, waiting for the
        worker included); after a refresh's step ``s+1``: ``snip_collect_s`` (steps 1-3 on
        its batch and the weights before it, after it) and ``snip_reduce_s`` (AdamW read +
        the all-reduce)."""
        metrics = {}
        if self._apply_s is not None:
            metrics["snip_apply_s"], self._apply_s = self._apply_s, None
        if self._snapshot is not None:
            start = time.perf_counter()
            snapshot, consumed = self._snapshot
            self._snapshot = None
            with snapshot.store:  # its files go at the end, also on an error
                a2, hyper = adam_squares(run.optimizer, run.model, snapshot.store)
                reduce_s = time.perf_counter() - start
                with snapshot.swapped():
                    observers, loss = collect(args, run, consumed, self.config.candidates,
                                              self.config.noise, a2=a2, store=snapshot.store,
                                              probe=self.config.probe,
                                              sites_per_pass=self.config.sites_per_pass)
            del snapshot, a2
            collect_s = time.perf_counter() - start - reduce_s
            stats = reduce_statistics(observers, args, self.config.candidates)
            step = state.iteration - 1
            self.pending = {"step": step, "apply": step + self.config.apply_lag,
                            "stats": [s.__dict__ for s in stats], "loss": loss, "hyper": hyper}
            self._start_worker()
            metrics.update(snip_refresh=step, snip_collect_s=collect_s,
                           snip_reduce_s=time.perf_counter() - start - collect_s)
        return metrics or None

    # -- worker (rank 0) -----------------------------------------------------------------
    def _start_worker(self) -> None:
        if dist.get_rank() != 0:
            return
        pending = self.pending
        self._result = None

        def work():
            start = time.perf_counter()
            stats = [SiteStats(**s) for s in pending["stats"]]
            plan, sol = self._solve(stats, pending["step"], pending["loss"], pending["hyper"])
            self._result = {"plan": plan.to_dict(), "solution": sol.to_dict(),
                            "seconds": time.perf_counter() - start}

        self._worker = threading.Thread(target=work, name="snip-planner", daemon=True)
        self._worker.start()

    def _apply(self) -> None:
        payload = [None]
        if dist.get_rank() == 0:
            if self._worker is None:  # resumed from a checkpoint: re-solve from its stats
                self._start_worker()
            self._worker.join()
            if self._result is None:
                raise RuntimeError("SNIP planner failed (see the traceback above)")
            payload[0] = self._result["plan"]
            print(f"snip: applying the plan of the step-{self.pending['step']} refresh "
                  f"(analysis + ILP {self._result['seconds']:.2f} s in the background)",
                  flush=True)
        dist.broadcast_object_list(payload, src=0)
        self.controller.set_base(PrecisionPlan.from_dict(payload[0]))
        self.pending, self._worker = None, None

    # -- steps 4-5 -----------------------------------------------------------------------
    def _solve(self, stats, step, loss, hyper):
        """:func:`solve_plan` warm-started from SNIP's plan in force; writes the refresh's
        files under ``<run dir>/snip/step_<s>/``."""
        base = self.controller.base
        warm = {sid: option_name(f) for sid, f in base.sites.items()} if base else None
        plan, solution, q, table, problem = solve_plan(self.config, self.args, self.config.policy,
                                                       stats, step, loss, hyper, warm)
        if self.args.run_dir:
            self._write(self.args.run_dir, step, stats, q, table, problem, solution, plan, loss,
                        hyper)
        return plan, solution

    def _write(self, run_dir, step, stats, q, table, problem, solution, plan, loss,
               hyper) -> None:
        out = os.path.join(run_dir, "snip", f"step_{step:06d}")
        os.makedirs(out, exist_ok=True)
        names = [option_name(o) for o in self.config.options]
        write_json_atomic(os.path.join(out, "stats.json"), {
            "version": 1, "step": step, "loss": loss, "adam": hyper,
            "candidates": self.config.candidates, "sites": [s.__dict__ for s in stats]})
        write_json_atomic(os.path.join(out, "divergence.json"),
                          _divergence_json(step, names, stats, q, table, self.config.policy))
        problem.save(os.path.join(out, "problem.json"))
        write_json_atomic(os.path.join(out, "solution.json"), solution.to_dict())
        write_json_atomic(os.path.join(out, "plan.json"), plan.to_dict())

    # -- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.pending = state.get("pending")
        self._worker = None


def _activations(args) -> float:
    """The dry run's estimate of a step's peak activation bytes on this rank's stage."""
    from megatron.core import parallel_state
    from megatron_ext.training.dry_run import estimates

    layout = estimates.Layout.from_args(args, args.transformer_impl)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    return estimates.activation_bytes(stage, args.num_layers // layout.pp, args.hidden_size,
                                      args.num_attention_heads, args.padded_vocab_size, layout)


def describe(config: SnipConfig, args) -> str:
    """The start-up line of ``--precision snip`` (or one of its baselines)."""
    name = "on" if config.policy == "snip" else f"baseline {config.policy}"
    line = (f"snip: {name} | FP4 budget E_t {config.budget:g} of the linear FLOPs | "
            f"candidates {args.snip_candidates} | stage balance {config.stage_balance}")
    if not config.refreshes:
        return line + " | static plan"
    every = f", then every {config.interval}" if config.interval else ", once"
    return (line + f" | statistics at step {config.start}{every}, each plan applied "
            f"{config.apply_lag} steps later (the safe plan until the first)")


def _divergence_json(step, names, stats, q, table, policy) -> dict:
    """ΔL, ΔW and Q per site and option (the same Q as problem.json); other policies: Q."""
    sites = {}
    if table is not None:
        for s, row in zip(stats, table):
            sites[s.site] = {n: {"dL": d.dL, "dW": d.dW, "q": d.q} for n, d in zip(names, row)}
    else:
        for s, row in zip(stats, np.asarray(q)):
            sites[s.site] = {n: {"dL": 0.0, "dW": 0.0, "q": float(v)} for n, v in zip(names, row)}
    return {"version": 1, "step": step, "policy": policy, "options": names, "sites": sites}


def snip_extension(controller: PlanController) -> Extension:
    """The SNIP Extension of one run: its six policies, refreshes replacing
    ``controller``'s base plan."""
    snip = SnipRun(controller)
    policies = tuple(Policy(name, snip.make_plan, owner="snip",
                            help="SNIP" if name == "snip" else f"SNIP's {name} baseline",
                            dry_run=snip.stand_in_plan if name in planner.STATS_POLICIES
                            else None) for name in POLICIES)

    def when_on(hook):
        return lambda args, *rest: hook(args, *rest) if snip.config is not None else None

    return Extension(name="snip", add_arguments=add_arguments, validate=snip.validate,
                     active=active, enabled_by=ENABLED_BY, policies=policies, plots=PLOTS,
                     conflicts=SnipConfig.CONFLICTS,
                     describe=when_on(lambda args: describe(snip.config, args)),
                     after_setup=when_on(snip.after_setup), before_step=when_on(snip.before_step),
                     on_step=when_on(snip.on_step),
                     dry_run_estimate=when_on(lambda args, context:
                                              dry_run.estimate(snip.config, args, context)))
