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

import argparse
import os
import threading
import time

import numpy as np
import torch.distributed as dist

from megatron_ext.precision.controller import PlanController
from megatron_ext.precision.cost import ModelShape, stage_fixed_seconds
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.policies import Policy, register_policy
from megatron_ext.sites import SITES, ROLES, site_id
from megatron_ext.precision.sites import SiteFormats
from megatron_ext.methods.snip import dry_run, memory, planner
from megatron_ext.methods.snip.divergence import SiteStats, divergences
from megatron_ext.methods.snip.ilp import STAGE_BALANCE, SolverConfig
from megatron_ext.methods.snip.options import DEFAULT_CANDIDATES, option_name, parse_candidates
from megatron_ext.io import write_json_atomic
from megatron_ext.methods.snip.refresh import (WeightSnapshot, adam_squares, collect,
                                               reduce_statistics)
from megatron_ext.errors import UsageError, finite_float
from megatron_ext.extension import Extension

POLICIES = planner.STATS_POLICIES + planner.STATIC_POLICIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("SNIP (--precision snip | random | min-abs-err | min-rel-err "
                                  "| e-layer-type | e-layer-id)")
    g.add_argument("--snip-budget", type=finite_float, default=0.5, metavar="E_t",
                   help="target fraction of linear-layer FLOPs in FP4 (eq. 2)")
    g.add_argument("--snip-candidates", default=DEFAULT_CANDIDATES, metavar="F1,F2,...",
                   help="formats each role may take: recipes fp8/fp4/bf16 or format names "
                        "(options = one per role)")
    g.add_argument("--snip-stage-balance", choices=STAGE_BALANCE, default="paper",
                   help="paper: eq. 5 (every stage >= E_t/K); time: cap every stage's "
                        "estimated time; none: eq. 2 only")
    g.add_argument("--snip-start", type=int, default=50, metavar="STEP",
                   help="first refresh before this step")
    g.add_argument("--snip-interval", type=int, default=100, metavar="STEPS",
                   help="steps between refreshes (0: only the first)")
    g.add_argument("--snip-apply-lag", type=int, default=2, metavar="STEPS",
                   help="a refresh's plan is applied this many steps after it")
    g.add_argument("--snip-noise", type=finite_float, default=1e-2, metavar="EPS",
                   help="probe noise std relative to the gradient's RMS per token (step 2) and "
                        "the input's RMS (step 3)")
    g.add_argument("--snip-loss-weight", type=finite_float, default=1.0, help="w_L in Q = w_L ΔL + w_W ΔW")
    g.add_argument("--snip-weight-weight", type=finite_float, default=1.0, help="w_W in Q")
    g.add_argument("--snip-time-limit", type=finite_float, default=30.0, help="ILP seconds (HiGHS)")
    g.add_argument("--snip-mip-gap", type=finite_float, default=1e-6, help="ILP relative MIP gap")
    g.add_argument("--snip-threads", type=int, default=1, help="HiGHS threads")
    g.add_argument("--snip-seed", type=int, default=0, help="seed of the random baseline")


def parse_flags(args) -> tuple[dict, list[SiteFormats]]:
    """SNIP's flags checked; returns (candidate formats per role, options)."""
    if not 0.0 <= args.snip_budget <= 1.0:
        raise UsageError(f"--snip-budget must be in [0, 1], got {args.snip_budget}")
    if args.snip_start < 0 or args.snip_interval < 0 or args.snip_apply_lag < 1:
        raise UsageError("--snip-start and --snip-interval must be >= 0 and "
                         "--snip-apply-lag >= 1")
    if args.snip_noise <= 0:
        raise UsageError(f"--snip-noise must be > 0, got {args.snip_noise}")
    try:
        cands = parse_candidates(args.snip_candidates)
    except ValueError as exc:
        raise UsageError(f"--snip-candidates: {exc}") from None
    return cands.all_formats(), cands.options()


def initial_plan(args, arg=None) -> PrecisionPlan:
    """The base plan before the first refresh (the registered policies' maker): the static
    baselines' ILP plan, else the **safe plan** (every role's first candidate)."""
    candidates, options = parse_flags(args)
    if args.precision in planner.STATIC_POLICIES:
        return solve_plan(args, args.precision, options, None, step=0)[0]
    first = SiteFormats(*(candidates[r][0] for r in ROLES))
    sites = {site_id(layer, s): first for layer in range(args.num_layers) for s in SITES}
    return PrecisionPlan(sites, method=f"{args.precision}:safe")


def solve_plan(args, policy: str, options, stats, step, loss=1.0, hyper=None, warm=None):
    """Steps 4-5: quality table -> ILP -> plan; returns (plan, solution, q, table, problem)
    (``table``: ΔL, ΔW, Q per site x option, ``snip`` only, kept for divergence.json)."""
    shape = ModelShape.from_args(args)
    sites = [site_id(layer, s) for layer in range(args.num_layers) for s in SITES]
    weights = (args.snip_loss_weight, args.snip_weight_weight)
    table = None
    if policy == "snip":
        table = divergences(stats, options, loss, hyper, *weights)
        q = planner.divergence_q(table)
    else:
        q = planner.quality_table(policy, stats, options, loss, hyper, shape, args.snip_seed,
                                  weights)
    fixed = stage_fixed_seconds(shape)
    problem = planner.build_problem(sites, options, q, shape, fixed,
                                    meta={"step": step, "policy": policy})
    config = SolverConfig(args.snip_time_limit, args.snip_mip_gap, args.snip_threads)
    plan, solution = planner.make_plan(problem, options, policy, step, args.snip_budget,
                                       args.snip_stage_balance, config, warm)
    return plan, solution, q, table, problem


class SnipRun:
    """One run's SNIP state: options, the pending refresh, the worker."""

    def __init__(self, controller: PlanController):
        self.controller = controller
        """The platform's plan controller: a refresh replaces its base plan."""
        self.policy: str | None = None
        self.options: list[SiteFormats] = []
        self.candidates: dict = {}
        self.pending: dict | None = None
        """The refresh awaiting its apply step: step, apply, stats, loss, hyper."""
        self._snapshot = None
        """(WeightSnapshot, consumed samples) of a refresh due, from before its step ``s+1``
        until its passes after that step."""
        self._worker: threading.Thread | None = None
        self._result: dict | None = None
        self._apply_s: float | None = None

    def validate(self, args) -> None:
        self.policy = args.precision if args.precision in POLICIES else None
        if self.policy is None:
            return
        if getattr(args, "use_torch_fsdp2", False):  # _weight_stats reads whole weights
            raise UsageError(f"--precision {self.policy} does not run under --use-torch-fsdp2 "
                             "yet (its statistics need unsharded weights)")
        self.candidates, self.options = parse_flags(args)

    def after_setup(self, args, run, state) -> None:
        if self.policy is None:
            return
        run.checkpointer.register("snip", self)
        if self.policy in planner.STATS_POLICIES:  # before the first step: would it fit?
            memory.check_fits(memory.of_run(args, run.model, self.candidates),
                              _activations(args))

    # -- schedule ----------------------------------------------------------------------
    def _refresh_due(self, args, step: int) -> bool:
        if self.policy not in planner.STATS_POLICIES or step < args.snip_start:
            return False
        if step == args.snip_start:
            return True
        return bool(args.snip_interval) and (step - args.snip_start) % args.snip_interval == 0

    def before_step(self, args, run, state) -> None:
        if self.pending is not None and state.iteration == self.pending["apply"]:
            start = time.perf_counter()
            self._apply(args)
            self._apply_s = time.perf_counter() - start
        if self._refresh_due(args, state.iteration):  # the passes run after the step
            self._snapshot = (WeightSnapshot(run.model), state.consumed_samples)

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
            a2, hyper = adam_squares(run.optimizer, run.model)
            reduce_s = time.perf_counter() - start
            with snapshot.swapped():
                observers, loss = collect(args, run, consumed, self.candidates,
                                          args.snip_noise, a2=a2)
            del snapshot, a2
            collect_s = time.perf_counter() - start - reduce_s
            stats = reduce_statistics(observers, args, self.candidates)
            step = state.iteration - 1
            self.pending = {"step": step, "apply": step + args.snip_apply_lag,
                            "stats": [s.__dict__ for s in stats], "loss": loss, "hyper": hyper}
            self._start_worker(args)
            metrics.update(snip_refresh=step, snip_collect_s=collect_s,
                           snip_reduce_s=time.perf_counter() - start - collect_s)
        return metrics or None

    # -- worker (rank 0) -----------------------------------------------------------------
    def _start_worker(self, args) -> None:
        if dist.get_rank() != 0:
            return
        pending = self.pending
        self._result = None

        def work():
            start = time.perf_counter()
            stats = [SiteStats(**s) for s in pending["stats"]]
            plan, sol = self._solve(args, stats, pending["step"], pending["loss"],
                                    pending["hyper"])
            self._result = {"plan": plan.to_dict(), "solution": sol.to_dict(),
                            "seconds": time.perf_counter() - start}

        self._worker = threading.Thread(target=work, name="snip-planner", daemon=True)
        self._worker.start()

    def _apply(self, args) -> None:
        payload = [None]
        if dist.get_rank() == 0:
            if self._worker is None:  # resumed from a checkpoint: re-solve from its stats
                self._start_worker(args)
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
    def _solve(self, args, stats, step, loss, hyper):
        """:func:`solve_plan` warm-started from SNIP's plan in force; writes the refresh's
        files under ``<run dir>/snip/step_<s>/``."""
        base = self.controller.base
        warm = {sid: option_name(f) for sid, f in base.sites.items()} if base else None
        plan, solution, q, table, problem = solve_plan(args, self.policy, self.options, stats,
                                                       step, loss, hyper, warm)
        if args.run_dir:
            self._write(args.run_dir, step, stats, q, table, problem, solution, plan, loss,
                        hyper)
        return plan, solution

    def _write(self, run_dir, step, stats, q, table, problem, solution, plan, loss,
               hyper) -> None:
        out = os.path.join(run_dir, "snip", f"step_{step:06d}")
        os.makedirs(out, exist_ok=True)
        names = [option_name(o) for o in self.options]
        write_json_atomic(os.path.join(out, "stats.json"), {
            "version": 1, "step": step, "loss": loss, "adam": hyper,
            "candidates": self.candidates, "sites": [s.__dict__ for s in stats]})
        write_json_atomic(os.path.join(out, "divergence.json"),
                          _divergence_json(step, names, stats, q, table, self.policy))
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

    layout = estimates.Layout.from_args(args)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    return estimates.activation_bytes(stage, args.num_layers // layout.pp, args.hidden_size,
                                      args.num_attention_heads, args.padded_vocab_size, layout)


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


for _name in POLICIES:
    register_policy(Policy(_name, initial_plan, owner="snip",
                           help="SNIP" if _name == "snip" else f"SNIP's {_name} baseline",
                           dry_run=dry_run.stand_in_plan
                           if _name in planner.STATS_POLICIES else None))


def describe(args) -> str:
    """The start-up line of ``--precision snip`` (or one of its baselines)."""
    name = "on" if args.precision == "snip" else f"baseline {args.precision}"
    line = (f"snip: {name} | FP4 budget E_t {args.snip_budget:g} of the linear FLOPs | "
            f"candidates {args.snip_candidates} | stage balance {args.snip_stage_balance}")
    if args.precision not in planner.STATS_POLICIES:
        return line + " | static plan"
    every = f", then every {args.snip_interval}" if args.snip_interval else ", once"
    return (line + f" | statistics at step {args.snip_start}{every}, each plan applied "
            f"{args.snip_apply_lag} steps later (the safe plan until the first)")


def snip_extension(controller: PlanController) -> Extension:
    """The SNIP Extension of one run; refreshes replace ``controller``'s base plan."""
    snip = SnipRun(controller)

    def active(hook):
        return lambda args, *rest: hook(args, *rest) if snip.policy is not None else None

    return Extension(name="snip", add_arguments=add_arguments, validate=snip.validate,
                     describe=active(describe),
                     after_setup=snip.after_setup, before_step=active(snip.before_step),
                     on_step=active(snip.on_step), dry_run_estimate=active(dry_run.estimate))
