"""The precision platform's Extension: flags, quantized linears, the plan controller on every rank.

``default_extensions()`` puts it last, after every method. Without a precision flag it does
nothing (megatron's own linears, bit for bit). With one:

1. ``validate`` makes the base plan from ``--precision NAME[:ARG]`` (``uniform`` or a policy
   one of the run's extensions brings, :mod:`.policies`) or ``--precision-plan``, checks it against the model (a bad file, bad JSON,
   unknown site or format is a one-line ``UsageError``) and lays ``--keep-first-last-layers-bf16``
   as the overlay ``precision/keep<N>bf16``;
2. ``linear_classes`` makes every site the one quantized megatron linear;
3. ``after_setup`` commits the plan and registers the controller with the checkpointer;
4. ``commit_step`` (after every extension's ``before_step``) commits whatever methods changed
   since the last step: the effective plan (derived overlays evaluated against the base) is
   applied on every rank, its hash all-gathered (every rank must hold the same plan) and the
   plan written to ``<run dir>/precision_plan.json``; rank 0 prints the FLOP split of the first
   plan, then of later ones at most once per :data:`PLAN_LINE_EVERY` steps, with the number of
   changes since the last line (GNMR changes the plan every few steps);
5. with several micro-batches a step, ``after_setup`` gives every linear a weight cache
   (:mod:`.weight_cache`: fprop's quantized weight made once per step), whose generation
   ``commit_step`` and ``on_step`` advance, so no step or evaluation sees another's weights;
6. ``on_step`` adds, on logged steps, the FLOP fractions, the plan hash and the sites changed
   since the last logged step (if any) to the step's metrics.

On ``--load`` the checkpoint's base plan and overlays replace the flags' (they are training
state, like the LR schedule) unless ``--override-precision-plan`` is given.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megatron_ext.errors import UsageError
from megatron_ext.extension import Extension
from megatron_ext.precision import device_profile, dry_run
from megatron_ext.precision import policies as policies_
from megatron_ext.precision.controller import PlanController, verify_same_plan
from megatron_ext.precision.cost import FlopReport, ModelShape, flop_report
from megatron_ext.precision.layers import apply_plan, cache_weights, quantized_linear_classes
from megatron_ext.precision.real_gemm import EXECUTION_CHOICES, describe
from megatron_ext.precision.plan import PrecisionPlan, load_plan, save_plan
from megatron_ext.precision.weight_cache import WeightReuse

PLAN_FILE = "precision_plan.json"
"""The plan in force, in the run directory (written by rank 0 whenever it changes)."""
PLAN_LINE_EVERY = 50
"""Steps between two ``precision: plan`` console lines (every change is in the metrics)."""
OWNER = "precision"
"""Owner name of the platform's own overlays."""


def add_arguments(parser: argparse.ArgumentParser, policies: policies_.PolicySet) -> None:
    g = parser.add_argument_group("precision (per-layer GEMM formats)")
    g.add_argument("--precision", default=None, metavar="POLICY[:ARG]",
                   help="make the base plan with a policy of this run: "
                        + ", ".join(policies.choices()) + " (<format>: any "
                        "megatron_ext.formats name, the same for x, w and dy: mxfp4, nvfp4, "
                        "mxfp8, fp8_e4m3@row, ...)")
    g.add_argument("--precision-plan", default=None, metavar="PLAN.json",
                   help="read the base plan from a PrecisionPlan JSON file (docs/precision.md)")
    g.add_argument("--keep-first-last-layers-bf16", type=int, default=0, metavar="N",
                   help="an overlay over any base plan: every site of the first and last N "
                        "layers in BF16")
    g.add_argument("--precision-backend", choices=["auto", "emulated"], default="auto",
                   help="auto: sites Transformer Engine supports run through TE on a capable "
                        "GPU; emulated: always fake-quantize")
    g.add_argument("--fp8-execution", choices=EXECUTION_CHOICES, default="auto",
                   help="how a GEMM whose two operands are FP8 (e4m3/e5m2 per tensor, per row, "
                        "1x128 tiles x 128x128 blocks) runs: real = torch._scaled_mm on FP8 data "
                        "(CPU too, per tensor / per row); auto = real on a GPU with FP8 tensor "
                        "cores (compute capability >= 8.9) wherever torch supports the scaling, "
                        "emulated elsewhere; emulated = fake-quantize, then a high-precision "
                        "GEMM. FP4 / MXFP4 / NVFP4 / MXFP8 are always emulated (Hopper has no "
                        "FP4 or MX tensor cores): their speed-ups are cost-model estimates")
    device_profile.add_argument(g)
    g.add_argument("--no-cache-quantized-weights", action="store_true",
                   help="quantize a weight in every GEMM that reads it; by default a step "
                        "quantizes it once (bit for bit the same training): fprop's at the "
                        "first of several micro-batches, reused by the rest (emulated weights "
                        "that backward keeps anyway, 128x128 blocks or per tensor, at no "
                        "memory cost; real FP8 ones at one byte per weight), and a real FP8 "
                        "dgrad's q(w) along N (per tensor: fprop's transposed, written by "
                        "the same cast) at one byte per weight until the step's last backward")
    g.add_argument("--override-precision-plan", action="store_true",
                   help="on --load, keep the flags' plan instead of the checkpoint's")


def flags_plan(args, policies: policies_.PolicySet):
    """(base plan, its policy or None) the flags ask for ((None, None) without precision
    flags); ``UsageError`` if bad."""
    if args.precision and args.precision_plan:
        raise UsageError("--precision and --precision-plan exclude each other")
    keep = args.keep_first_last_layers_bf16
    if keep < 0:
        raise UsageError("--keep-first-last-layers-bf16 must be >= 0")
    if 2 * keep > args.num_layers:
        raise UsageError(f"--keep-first-last-layers-bf16 {keep}: the model has "
                         f"{args.num_layers} layers, so the first and last {keep} overlap; "
                         f"give at most {args.num_layers // 2} (then every layer is BF16)")
    if not (args.precision or args.precision_plan):
        if keep:
            raise UsageError("--keep-first-last-layers-bf16 needs --precision or "
                             "--precision-plan")
        return None, None
    flag = "--precision" if args.precision else "--precision-plan"
    try:
        policy = policies.lookup(args.precision)[0] if args.precision else None
        plan = (policies.make_plan(args.precision, args) if args.precision
                else load_plan(args.precision_plan))
        plan.check_model(args.num_layers)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    return plan, policy


class PrecisionRun:
    """The platform's per-run state: the controller and the plan in force on this rank."""

    def __init__(self, controller: PlanController | None = None, policies=()):
        self.controller = controller or PlanController()
        """Base plan + overlays; methods change it, :meth:`commit` applies it."""
        self.policies = policies_.PolicySet(policies)
        """The policies ``--precision`` may name: ``uniform`` and the run's extensions'."""
        self.report: FlopReport | None = None
        """The FLOP split of the plan in force."""
        self.device = device_profile.PROFILES["nominal"]
        """The device profile the estimated GEMM time is for (``--device-profile``)."""
        self.changed: list[str] | None = None
        """Sites the commits changed since the last logged step, until ``on_step`` reports
        them (on the next logged step)."""
        self.model = None
        self.args = None
        self.weight_reuse: WeightReuse | None = None
        """The weights' generation while they are quantized once per step, else None."""
        self.printed_at: int | None = None
        """The step of the last ``precision: plan`` line (None: none yet)."""
        self.unprinted = 0
        """Plan changes since that line."""

    def validate(self, args) -> None:
        self.device = device_profile.resolve(args.device_profile)  # a bad file: exit 2 here
        plan, policy = flags_plan(args, self.policies)
        if plan is not None:
            self.controller.set_base(plan)
            self.controller.stand_in = policy.dry_run if policy is not None else None
            keep = policies_.keep_overlay(args.keep_first_last_layers_bf16, args.num_layers)
            self.controller.set_overlay(keep.owner, keep.name, keep.sites, keep.rule)
        self.controller.flags_read = True
        self.controller.check_plan_needed()

    def linear_classes(self, args):
        if self.controller.base is None and not self.controller.linears_for:
            return None
        return quantized_linear_classes(te_allowed=args.precision_backend == "auto",
                                        fp8_execution=args.fp8_execution)

    def after_setup(self, args, run, state) -> None:
        if self.controller.base is None:
            return
        self.model, self.args = run.model, args
        if dist.get_rank() == 0:
            print(describe(args.fp8_execution, _model_device(run.model)), flush=True)
        self.commit(state.iteration)
        run.checkpointer.register("precision_plan", self)
        if not args.no_cache_quantized_weights:
            self.weight_reuse = WeightReuse(args.num_microbatches)
            cache_weights(run.model, self.weight_reuse)
            if dist.get_rank() == 0:
                what = (f"for its {args.num_microbatches} micro-batches (fprop's, and a real "
                        "FP8 dgrad's along N)" if args.num_microbatches > 1 else
                        "for fprop and a real FP8 dgrad")
                print(f"precision: quantized weights made once per step {what} "
                      "(--no-cache-quantized-weights: in every GEMM)", flush=True)

    def commit_step(self, args, run, state) -> None:
        if self.weight_reuse is not None:
            self.weight_reuse.new_weights()  # whatever ran between steps, this one starts anew
        if self.model is not None:
            self.commit(state.iteration)

    def commit(self, step: int | None = None) -> None:
        """Apply the controller's effective plan if it changed (every rank, same step): fill in
        this layout's per-stage FP4 fractions, apply, check every rank holds the same plan; on
        rank 0 write :data:`PLAN_FILE` and print the split (:meth:`_print`). ``step`` None
        (a restored checkpoint plan) prints at once."""
        changed = self.controller.changes()
        if changed is None:
            self._print(step)
            return
        plan = self.controller.effective()
        report = flop_report(plan.formats, ModelShape.from_args(self.args),
                             profile=self.device)
        plan = plan.replace(stage_fp4_frac=[s["fp4"] for s in report.stage_fractions])
        apply_plan(self.model, plan, self.args.num_layers)
        verify_same_plan(plan)
        self.controller.applied, self.report = plan, report
        self.changed = changed if self.changed is None else sorted({*self.changed, *changed})
        self.unprinted += 1
        if dist.get_rank() == 0 and getattr(self.args, "run_dir", None):
            save_plan(plan, os.path.join(self.args.run_dir, PLAN_FILE))
        self._print(step)

    def _print(self, step: int | None) -> None:
        """Rank 0: the plan line, unless one was printed less than PLAN_LINE_EVERY steps ago
        (then it waits: a later call prints the plan in force and the count of changes)."""
        if not self.unprinted or dist.get_rank() != 0:
            return
        if None not in (step, self.printed_at) and step - self.printed_at < PLAN_LINE_EVERY:
            return
        count = (f" | {self.unprinted} plan changes since step {self.printed_at}"
                 if self.unprinted > 1 else "")
        print(_summary(self.controller.applied, self.report) + count, flush=True)
        self.printed_at = step if step is not None else self.printed_at
        self.unprinted = 0

    def on_step(self, args, run, state) -> dict | None:
        if self.weight_reuse is not None:
            self.weight_reuse.new_weights()  # the optimizer step changed them
        if self.controller.applied is None or not run.step_result["logged"]:
            return None  # changed sites wait for the next logged step
        metrics = {**self.report.metrics(), "precision_plan": self.controller.applied.hash[:12]}
        if self.changed:
            metrics["precision_changed_sites"] = self.changed
        self.changed = None
        return metrics

    def state_dict(self) -> dict:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict) -> None:
        before = self.controller.effective()
        if self.args.override_precision_plan:
            return
        self.controller.load_state_dict(state)
        saved = self.controller.effective()
        if saved.sites != before.sites and dist.get_rank() == 0:
            print(f"precision: restoring the checkpoint's plan ({saved.method}) over the "
                  f"flags' plan ({before.method}); --override-precision-plan keeps the flags'",
                  flush=True)
        self.commit()


def _model_device(model) -> torch.device:
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    return next(chunk.parameters()).device


def _summary(plan: PrecisionPlan, report: FlopReport) -> str:
    split = " ".join(f"{c.upper()} {100 * f:.1f}%" for c, f in report.fractions.items())
    stages = ", ".join(f"{100 * f:.1f}%" for f in plan.stage_fp4_frac)
    return (f"precision: plan {plan.method} ({plan.hash[:12]}) | linear FLOPs {split} | "
            f"FP4 per stage [{stages}] | est. GEMM time {report.time_vs_bf16:.2f}x BF16 "
            f"(device {report.profile})")


def has_plan_flags(args: argparse.Namespace) -> bool:
    """``--precision`` or ``--precision-plan``: without a plan, the platform's other flags
    (``--fp8-execution``, ``--precision-backend``, ``--no-cache-quantized-weights``, ...)
    would change nothing and are refused (``Extension.active``)."""
    return bool(args.precision or args.precision_plan)


def precision_extension(run: PrecisionRun | None = None) -> Extension:
    """The platform Extension of one run (a fresh :class:`PrecisionRun` by default: only the
    ``uniform`` policy)."""
    run = run or PrecisionRun()
    return Extension(name=OWNER, add_arguments=lambda parser: add_arguments(parser, run.policies),
                     active=has_plan_flags, enabled_by="--precision POLICY or --precision-plan "
                     "PLAN.json", validate=run.validate,
                     linear_classes=run.linear_classes, after_setup=run.after_setup,
                     commit_step=run.commit_step, on_step=run.on_step,
                     dry_run_estimate=lambda args, context:
                     dry_run.estimate(run.controller, args, context))
