"""The precision Extension: flags, quantized linears in the layer specs, the plan on every rank.

Entry points use it as ``main("llama", extensions=[precision_extension()])``. Without a
precision flag it does nothing (megatron's own linears, bit for bit). With one:

1. ``validate`` builds the plan from ``--precision`` or ``--precision-plan`` (then
   ``--keep-first-last-layers-bf16``) and checks it against the model: a bad file, bad JSON,
   unknown site or format is a one-line ``UsageError``;
2. ``linear_classes`` makes every site a quantized megatron linear;
3. ``after_setup`` applies the plan, all-gathers its hash (every rank must hold the same plan),
   registers it with the checkpointer, prints the FLOP split on rank 0 and writes the plan to
   ``<run dir>/precision_plan.json`` there (rewritten whenever a new plan is applied);
4. ``on_step`` adds the FLOP fractions (overall and per stage) and the plan hash to every
   step's metrics.

On ``--load`` the checkpoint's plan replaces the flags' plan (it is training state, like the
LR schedule) unless ``--override-precision-plan`` is given. :meth:`PrecisionRun.set_plan` is
how a policy switches plans mid-run (all ranks at the same step).
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from megatron_ext.precision.cost import FlopReport, ModelShape, flop_report
from megatron_ext.precision.layers import quantized_linear_classes
from megatron_ext.precision.plan import (PrecisionPlan, apply_plan, load_plan, save_plan,
                                         verify_same_plan)
from megatron_ext.precision.policies import keep_layers_bf16, plan_from_spec, policy_choices
from megatron_ext.errors import UsageError
from megatron_ext.extension import Extension

PLAN_FILE = "precision_plan.json"
"""The plan in force, in the run directory (written by rank 0 whenever a plan is applied)."""


def add_arguments(parser: argparse.ArgumentParser, extra_policies: dict | None = None) -> None:
    g = parser.add_argument_group("precision (per-layer GEMM formats)")
    choices = ", ".join(policy_choices() + sorted(extra_policies or {}))
    g.add_argument("--precision", default=None, metavar="POLICY[:ARG]",
                   help=f"make the plan with a policy: {choices}")
    g.add_argument("--precision-plan", default=None, metavar="PLAN.json",
                   help="read the plan from a PrecisionPlan JSON file (docs/precision.md)")
    g.add_argument("--keep-first-last-layers-bf16", type=int, default=0, metavar="N",
                   help="run every site of the first and last N layers in BF16")
    g.add_argument("--precision-backend", choices=["auto", "emulated"], default="auto",
                   help="auto: sites Transformer Engine supports run through TE on a capable "
                        "GPU; emulated: always fake-quantize")
    g.add_argument("--override-precision-plan", action="store_true",
                   help="on --load, keep the flags' plan instead of the checkpoint's")


def _flags_plan(args, extra_policies: dict | None = None) -> PrecisionPlan | None:
    """The plan the flags ask for (None without precision flags); ``UsageError`` if bad."""
    extra_policies = extra_policies or {}
    if args.precision in extra_policies:
        if args.precision_plan or args.keep_first_last_layers_bf16:
            raise UsageError(f"--precision {args.precision} chooses every site itself: drop "
                             "--precision-plan / --keep-first-last-layers-bf16")
        return extra_policies[args.precision](args)
    if args.precision and args.precision_plan:
        raise UsageError("--precision and --precision-plan exclude each other")
    keep = args.keep_first_last_layers_bf16
    if keep < 0:
        raise UsageError("--keep-first-last-layers-bf16 must be >= 0")
    if not (args.precision or args.precision_plan):
        if keep:
            raise UsageError("--keep-first-last-layers-bf16 needs --precision or "
                             "--precision-plan")
        return None
    flag = "--precision" if args.precision else "--precision-plan"
    try:
        plan = (plan_from_spec(args.precision, args.num_layers) if args.precision
                else load_plan(args.precision_plan))
        plan.check_model(args.num_layers)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    return keep_layers_bf16(plan, keep, args.num_layers)


class PrecisionRun:
    """One training run's precision state: the plan in force and its FLOP report."""

    def __init__(self, extra_policies: dict | None = None):
        self.extra_policies = extra_policies or {}
        """Policy name -> ``make(args) -> PrecisionPlan`` beyond :mod:`.policies` (SNIP's)."""
        self.plan: PrecisionPlan | None = None
        self.report: FlopReport | None = None
        self.model = None
        self.args = None

    def validate(self, args) -> None:
        self.plan = _flags_plan(args, self.extra_policies)

    def linear_classes(self, args):
        if self.plan is None:
            return None
        return quantized_linear_classes(te_allowed=args.precision_backend == "auto")

    def after_setup(self, args, model, checkpointer) -> None:
        if self.plan is None:
            return
        self.model, self.args = model, args
        self.set_plan(self.plan)
        checkpointer.register("precision_plan", self)

    def set_plan(self, plan: PrecisionPlan) -> None:
        """Apply ``plan`` on this rank (with this layout's per-stage FP4 fractions filled in),
        check every rank holds the same one; on rank 0 print the split and write the plan to
        ``<run dir>/precision_plan.json`` (:data:`PLAN_FILE`)."""
        shape = ModelShape.from_args(self.args)
        report = flop_report(plan.formats, shape)
        plan = plan.replace(stage_fp4_frac=[s["fp4"] for s in report.stage_fractions])
        apply_plan(self.model, plan, self.args.num_layers)
        verify_same_plan(plan)
        self.plan, self.report = plan, report
        if dist.get_rank() == 0:
            print(_summary(plan, report), flush=True)
            if getattr(self.args, "run_dir", None):
                save_plan(plan, os.path.join(self.args.run_dir, PLAN_FILE))

    def on_step(self, args, model, state) -> dict | None:
        if self.plan is None:
            return None
        return {**self.report.metrics(), "precision_plan": self.plan.hash[:12]}

    def state_dict(self) -> dict:
        return {"plan": self.plan.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        saved = PrecisionPlan.from_dict(state["plan"])
        if self.args.override_precision_plan or saved.sites == self.plan.sites:
            return
        if dist.get_rank() == 0:
            print(f"precision: restoring the checkpoint's plan ({saved.method}, "
                  f"{saved.hash[:12]}) over the flags' plan ({self.plan.method}, "
                  f"{self.plan.hash[:12]}); --override-precision-plan keeps the flags'",
                  flush=True)
        self.set_plan(saved)


def _summary(plan: PrecisionPlan, report: FlopReport) -> str:
    split = " ".join(f"{c.upper()} {100 * f:.1f}%" for c, f in report.fractions.items())
    stages = ", ".join(f"{100 * f:.1f}%" for f in plan.stage_fp4_frac)
    return (f"precision: plan {plan.method} ({plan.hash[:12]}) | linear FLOPs {split} | "
            f"FP4 per stage [{stages}] | est. GEMM time {report.time_vs_bf16:.2f}x BF16")


def precision_extension(run: PrecisionRun | None = None) -> Extension:
    """The precision Extension of one run (a fresh :class:`PrecisionRun` by default)."""
    run = run or PrecisionRun()
    return Extension(name="precision",
                     add_arguments=lambda parser: add_arguments(parser, run.extra_policies),
                     validate=run.validate,
                     linear_classes=run.linear_classes, after_setup=run.after_setup,
                     on_step=run.on_step)
