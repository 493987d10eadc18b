"""``--gnmr`` in training: norms every step, Algorithm 2, the promotion overlay, trace, state.

One step ``t`` of a run with ``--gnmr`` (hooks in the order of ``default_extensions()``:
faults, SNIP, GNMR, ..., the precision platform last):

1. ``before_step``: the overlay ``gnmr/promotions`` (rule ``raise``) is laid as a *derived*
   overlay, "the units the last decision left high, lifted" (:func:`.promote.promotion_overlay`
   of whatever base is in force); the platform's ``commit_step``, after every extension's
   ``before_step``, evaluates it against the base of that moment and commits it on every
   rank. So it follows a base set by anyone, in any hook order (a SNIP refresh, an outside
   method appended after GNMR): the promoted sites are lifted from the new base (SNIP's FP8
   site to BF16, not the old FP4 one to FP8), at the step the new base takes effect, and the
   promotions survive the refresh.
2. the step; the optimizer's ``step()`` is wrapped (``wrap_optimizer``) so that, after the
   backward and its DP reduction and **before** megatron clips the gradients (in place, in
   the DDP buffer), this rank's float64 sums of squares of the gradient elements it owns
   are taken (:meth:`.grads.NormReader.measure`). Reading there gives the unclipped values
   exactly; recovering them afterwards by dividing by the clip coefficient would carry the
   rounding of the in-place multiply and need megatron's coefficient
   (``clip_grad / (norm + 1e-6)``, applied only when below 1), which the loop does not expose.
3. ``on_step``: one float64 all-reduce over the world gives every rank every unit's norm
   (:meth:`.grads.NormReader.reduce`), :meth:`GnmrController.step` decides the units of step
   ``t + 1``; rank 0 appends the decision's line to ``<run dir>/gnmr/trace.jsonl`` (strict
   JSON, flushed) and the step's metrics get ``gnmr_units_high``, ``gnmr_promotions``,
   ``gnmr_demotions``, the cumulative ``gnmr_unit_steps_high`` with ``gnmr_units`` (the
   promoted fraction so far is their ratio over the step), the controller's counters and
   ``gnmr_s``, the seconds GNMR took in this step (steps 1-3).

Under ``--gnmr-rule autoswitch`` hooks on the quantized linears also sum each low-precision
operand's quantization statistics during the step (:mod:`.operand_stats`, reset in
``before_step``), reduced in ``on_step`` by a second all-reduce; their cost is inside the
forward / backward, not in ``gnmr_s``. The other baselines (:mod:`.rules`) need only the
norms.

A skipped step (non-finite loss or gradients: the optimizer never ran, so nothing was
measured) is measured in ``on_nonfinite`` straight from the unclipped buffers and handled by
:meth:`GnmrController.on_nonfinite` (the units with non-finite norms, or the one that jumped
most, promoted with a full lock).

State: the controller (running means, ring buffers, locks, promotions) is checkpoint state
``gnmr``; the overlay itself is the platform's, so a resume restores both and continues
bit for bit. A run resumed *without* ``--gnmr`` drops the checkpoint's GNMR overlay (nothing
would ever demote it). On resume the trace gets the lines of the steps after the checkpoint
again: a reader keeps the last line of each step.
"""

from __future__ import annotations

import json
import os
import time
from functools import partial

import torch.distributed as dist

from megatron_ext.errors import UsageError
from megatron_ext.extension import Extension
from megatron_ext.methods.gnmr import dry_run, flags
from megatron_ext.methods.gnmr.decisions import Decision, GnmrConfig, GnmrController
from megatron_ext.methods.gnmr.grads import NormReader
from megatron_ext.methods.gnmr.operand_stats import OperandStatsCollector
from megatron_ext.methods.gnmr.plots import PLOTS
from megatron_ext.methods.gnmr.promote import promotion_overlay
from megatron_ext.methods.gnmr.units import unit_ids
from megatron_ext.precision.controller import PlanController
from megatron_ext.sites import all_site_ids

OWNER, OVERLAY = "gnmr", "promotions"
"""The plan controller overlay GNMR owns."""
TRACE = os.path.join("gnmr", "trace.jsonl")
"""The per-step trace, relative to the run directory."""


class GnmrRun:
    """One run's GNMR: settings, the controller, the norm reader, the trace file."""

    def __init__(self, plans: PlanController):
        self.plans = plans
        """The platform's plan controller (GNMR owns one overlay on it)."""
        self.config: GnmrConfig | None = None
        """The settings (None: ``--gnmr`` is off)."""
        self.gnmr: GnmrController | None = None
        """Algorithm 2 over this run's units (the same on every rank)."""
        self.reader: NormReader | None = None
        """Measures and reduces the unit norms."""
        self.measured = None
        """This step's local squares, from the wrapped ``optimizer.step``."""
        self.seconds = 0.0
        """Time GNMR spent in the current step so far."""
        self.trace = None
        """The open trace file (rank 0, once written)."""
        self.run_dir: str | None = None
        """``--run-dir`` (the trace goes under it; None: no trace)."""
        self.stats: OperandStatsCollector | None = None
        """Operand statistics of each step (``--gnmr-rule autoswitch`` only)."""

    def validate(self, args) -> None:
        self.config = flags.config_from_args(args)
        if self.config is not None:
            self.plans.require_plan(flags.NEEDS_PLAN)
            units = unit_ids(args.num_layers, self.config.granularity)
            try:
                self.gnmr = GnmrController.create(self.config, units, args.train_iters)
            except ValueError as exc:  # a setting that does not fit this run's length
                raise UsageError(str(exc)) from None
            self.reader = NormReader(units, self.config.granularity)
            self.run_dir = args.run_dir
            if self.config.rule == "autoswitch":
                self.stats = OperandStatsCollector(self.plans, all_site_ids(args.num_layers),
                                                   units, self.config.granularity)

    # -- hooks ---------------------------------------------------------------------------
    def wrap_optimizer(self, args, model, optimizer):
        """``optimizer.step`` measures the local squares first (module docstring, step 2)."""
        if self.config is None:
            return optimizer
        step = optimizer.step

        def measured_step(*a, **kw):
            start = time.perf_counter()
            self.measured = self.reader.measure(model)
            self.seconds += time.perf_counter() - start
            return step(*a, **kw)

        optimizer.step = measured_step
        return optimizer

    def after_setup(self, args, run, state) -> None:
        if self.config is not None:
            run.checkpointer.register(OWNER, self)
        if self.stats is not None:
            self.stats.attach(run.model)

    def before_step(self, args, run, state) -> None:
        start = time.perf_counter()
        if self.config is not None:
            self._lay()
            if self.stats is not None:
                self.stats.reset(state.iteration)
        elif (stale := self.plans.overlay(OWNER, OVERLAY)) is not None and stale.sites:
            self.plans.set_overlay(OWNER, OVERLAY, {}, rule="raise")
            if dist.get_rank() == 0:
                print(f"gnmr: dropping the checkpoint's GNMR promotions of "
                      f"{len(stale.sites)} site(s) (--gnmr is off)", flush=True)
        self.seconds = time.perf_counter() - start

    def _lay(self) -> None:
        """Lay the overlay: the promoted units, lifted from the base in force at the commit."""
        self.plans.set_overlay(OWNER, OVERLAY, rule="raise", derive=partial(
            promotion_overlay, units=self.gnmr.promoted, high=self.config.high))

    def on_step(self, args, run, state) -> dict | None:
        if self.config is None or run.step_result["skipped"]:
            return None  # a skipped step was handled by on_nonfinite
        start = time.perf_counter()
        measured, self.measured = self.measured, None
        if measured is None:
            raise RuntimeError("gnmr: the optimizer step ran without measuring the gradient "
                               "norms (was the optimizer replaced after wrap_optimizer?)")
        decision = self.gnmr.step(state.iteration, self.reader.reduce(measured),
                                  self._operand_stats())
        return self._report(decision, start)

    def on_nonfinite(self, args, run, state) -> dict | None:
        if self.config is None:
            return None
        start = time.perf_counter()
        self.measured = None
        norms = self.reader.reduce(self.reader.measure(run.model))
        return self._report(self.gnmr.on_nonfinite(state.iteration, norms,
                                                   self._operand_stats()), start)

    def _operand_stats(self):
        """This step's reduced operand statistics (autoswitch; None otherwise). Collective."""
        return self.stats.reduce() if self.stats is not None else None

    def on_train_end(self, args, run, state) -> None:
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    # -- output --------------------------------------------------------------------------
    def _report(self, decision: Decision, start: float) -> dict:
        """Append the trace line (rank 0); the step's metrics."""
        if dist.get_rank() == 0 and self.run_dir:
            if self.trace is None:
                path = os.path.join(self.run_dir, TRACE)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self.trace = open(path, "a", encoding="utf-8")
            self.trace.write(json.dumps(decision.trace, allow_nan=False) + "\n")
            self.trace.flush()
        self.seconds += time.perf_counter() - start
        return {**decision.metrics(), "gnmr_s": self.seconds}

    # -- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.gnmr.state_dict()

    def load_state_dict(self, state: dict) -> None:
        try:
            self.gnmr.load_state_dict(state)
        except ValueError as exc:
            raise UsageError(f"--load: {exc} (--gnmr-granularity and --gnmr-delta must match "
                             f"the checkpoint's)") from None


def describe(config: GnmrConfig) -> str:
    """The start-up line of ``--gnmr``: the rule and its settings."""
    line = f"gnmr: on | rule {config.rule} | per {config.granularity}, promote to {config.high}"
    if config.rule in ("first-last", "static-topk"):
        return line + f" | top-K {config.topk}"
    if config.rule == "autoswitch":
        return (line + f" | underflow > {config.autoswitch_underflow_pct:g}% or MSE > "
                f"{config.autoswitch_mse:g}")
    return (line + f" | lock {config.lock} steps, at most {config.max_promoted} promoted | "
            f"alpha {config.alpha_init:g} -> {config.alpha:g}, beta {config.beta_init:g} -> "
            f"{config.beta:g} (warm-up {config.warmup_frac:g} of the run), compare "
            f"{config.compare} over {config.delta} steps")


def gnmr_extension(plans: PlanController) -> Extension:
    """The GNMR Extension of one run; its promotions are an overlay on ``plans``."""
    run = GnmrRun(plans)
    return Extension(name=OWNER, add_arguments=flags.add_arguments, validate=run.validate,
                     describe=lambda args: describe(run.config) if run.config else None,
                     active=flags.active, enabled_by="--gnmr", plots=PLOTS,
                     conflicts=GnmrConfig.CONFLICTS,
                     wrap_optimizer=run.wrap_optimizer, after_setup=run.after_setup,
                     before_step=run.before_step, on_step=run.on_step,
                     on_nonfinite=run.on_nonfinite, on_train_end=run.on_train_end,
                     dry_run_estimate=lambda args, context:
                     dry_run.estimate(run.config, plans, args, context))
