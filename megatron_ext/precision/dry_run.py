"""The precision platform's part of ``--dry-run``: per-stage FLOPs, FP4 share and time.

**The plan the numbers assume** is the one the run would start with: the controller's base
plan (``--precision NAME[:ARG]`` through the run's policies, or ``--precision-plan``) under
its overlays (``--keep-first-last-layers-bf16``, any a method laid while validating), as
``validate`` left them. A policy whose plan only training can decide (SNIP and its statistics
baselines refresh from measured statistics) brings a ``Policy.dry_run(args, shape)`` hook,
which the platform hands the controller as its ``stand_in``, and its plan stands in for the
base. Without a precision flag every GEMM is BF16.

**The numbers** are the cost model's (:mod:`.cost`), per stage of the layout megatron-core
built: the linear sites' FLOPs of one step and their FP4 share (``T`` = global batch x
sequence), and the forward + backward time of one micro-batch on one GPU (``T = s·b``):
its sites' GEMMs at the rate of their class, plus the attention core of its layers and, on
the last stage, the output layer (BF16), all divided by TP. Peak rate, no communication:
a lower bound. The training side turns the stage times into the step time and tokens/s.

**Memory**: per stage, what its quantized GEMMs keep for the backward beyond megatron's
linears (:mod:`.kept`: fprop's quantized weights, FP8 weights cached for the step, ``q(x)``
kept in FP8), each micro-batch's share times the micro-batches the stage holds; the report
adds it to the stage's total (its ``extra`` column).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_ext.extension import DryRunPart, StageTimes
from megatron_ext.precision.controller import PlanController, compose
from megatron_ext.precision.cost import ModelShape, flop_report, stage_seconds
from megatron_ext.precision import device_profile
from megatron_ext.precision.kept import kept_bytes, site_geometry
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.real_gemm import executes_real
from megatron_ext.precision.site_formats import SiteFormats, resolve
from megatron_ext.sites import SITES, site_id

NO_PLAN = "none: BF16 GEMMs"
"""What the times assume without a precision flag."""
GPU_CAPABILITY = (9, 0)
"""CUDA compute capability of the GPU the times assume (H100: ``--dry-run-bf16-tflops``'s
default), asked of ``--fp8-execution`` as the job's device is (``real_gemm.executes_real``)."""


def micro_batch_shape(args, context) -> ModelShape:
    """The run's shape charged for one micro-batch (``T = s·b``), with the padded vocabulary
    of the dry run's ``context``: what ``Policy.dry_run`` hooks receive."""
    return dataclasses.replace(ModelShape.from_args(args),
                               tokens=args.micro_batch_size * args.seq_length,
                               vocab_size=context.vocab)


def assumed_plan(args, controller: PlanController, shape: ModelShape) -> PrecisionPlan | None:
    """The plan the run would start with (module docstring), None without precision flags."""
    if controller.base is None:
        return None
    base = controller.base
    if controller.stand_in is not None:
        base = controller.stand_in(args, shape)
    return compose(base, list(controller.overlays.values()))


def kept_memory(args, context, formats_of) -> list[float]:
    """Per stage, bytes one GPU's quantized GEMMs keep beyond megatron's linears under
    ``formats_of(site_id) -> SiteFormats`` (module docstring; :mod:`.kept`)."""
    layout, shape = context.layout, ModelShape.from_args(args)
    dtype = torch.bfloat16 if layout.bf16 else torch.float32
    real = executes_real(args.fp8_execution, GPU_CAPABILITY)
    cached = not args.no_cache_quantized_weights
    tokens = layout.seq * layout.micro_batch
    step, micro = [0.0] * len(context.stages), [0.0] * len(context.stages)
    for layer, stage in enumerate(context.layer_stages):
        for site in SITES:
            geometry = site_geometry(shape, site, tokens, layout.tp, layout.sequence_parallel,
                                     layout.flash_attention)
            kept = kept_bytes(resolve(formats_of(site_id(layer, site))), geometry, dtype,
                              real, cached, layout.micro_batches)
            step[stage] += kept.per_step
            micro[stage] += kept.per_micro_batch
    return [s + context.held(k) * m for k, (s, m) in enumerate(zip(step, micro))]


def estimate(controller: PlanController, args, context) -> DryRunPart:
    """The platform's part of the report (module docstring)."""
    shape = micro_batch_shape(args, context)
    plan = assumed_plan(args, controller, shape)
    formats_of = plan.formats if plan is not None else (lambda sid: SiteFormats())
    stage_of = context.layer_stages
    step = dataclasses.replace(shape, tokens=args.global_batch_size * args.seq_length)
    profile = device_profile.resolve(getattr(args, "device_profile", None))
    flops = flop_report(formats_of, step, stage_of)
    seconds = [t / context.layout.tp for t in
               stage_seconds(formats_of, shape, context.bf16_flops_per_s, stage_of, profile)]
    sites = [len(SITES) * len(s.layers) for s in context.stages]
    fp4 = [f["fp4"] for f in flops.stage_fractions]
    kept = kept_memory(args, context, formats_of)
    method = plan.method if plan is not None else NO_PLAN
    how = (f"forward + backward of one micro-batch on one GPU at "
           f"{context.bf16_flops_per_s / 1e12:g} TFLOP/s BF16 (device profile {profile.name}: "
           f"native formats at their rates, emulated ones quantize + BF16), attention core "
           f"6·b·s²·h per layer, output layer 6·s·b·v·h, no communication: a lower bound")
    return DryRunPart(
        columns=("sites", "lin PFLOP", "FP4"),
        cells=tuple((str(n), f"{f / 1e15:.1f}", f"{100 * x:.0f}%")
                    for n, f, x in zip(sites, flops.stage_flops, fp4)),
        stage_json=tuple({"sites": n, "linear_flops": f, "fp4_fraction": x,
                          "quantized_gemm_kept_bytes": m}
                         for n, f, x, m in zip(sites, flops.stage_flops, fp4, kept)),
        times=StageTimes(tuple(seconds), f"plan {method}", how),
        memory=tuple(kept) if any(kept) else (),
        notes=(_kept_note(kept),) if any(kept) else (),
        json={"plan": method})


def _kept_note(kept: list[float]) -> str:
    """The memory note: what the quantized GEMMs keep, stage 0's share."""
    return (f"extra: the quantized GEMMs keep {kept[0] / 2**30:+.2f} GiB on stage 0 beyond "
            "megatron's linears (fprop's quantized weights where dgrad reuses them, FP8 "
            "weights cached for the step, q(x) kept in FP8; docs/dry_run.md)")
