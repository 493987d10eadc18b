"""GNMR's part of ``--dry-run``: App. D's peak-memory bound for maxO promoted units, per stage.

The plan the bound starts from is the one the run would start with, as the precision
platform's part assumes it (:func:`megatron_ext.precision.dry_run.assumed_plan`: the base
plan, SNIP's stand-in for its policies, the overlays laid while validating). For each unit
of a stage, ``E_u`` = the extra bytes of the ``x`` its sites keep for wgrad when promoted
(:func:`.memory.unit_extra_bytes`, one micro-batch ``T = s·b``, the run's TP and sequence
parallelism; the run's dtype, 16 or 32 bits, for an unquantized ``x``); one GPU of stage
``k`` then needs at most

    ΔM_k ≤ m_k · Σ_{top min(maxO, U_k) units of the stage by E_u} E_u        (eq. 62)

with ``m_k`` the micro-batches of one unit's activations held at the schedule's peak:
``min(p - k, m)`` for 1F1B; with ``v`` virtual stages the stage's chunk-micro-batches in
flight (:func:`megatron_ext.training.dry_run.estimates.in_flight`), capped at ``m`` since a
unit sits in one chunk. The bound is reported, **not** added to the stage's memory total:
that total counts activations at 16 bits (Korthikanti et al.), which already covers a
promoted ``x`` in FP8 or BF16; the bound is what kernels keeping the quantized ``x`` would
add over keeping the low format. The line also sizes the per-step all-reduce (``U``
float64 values over the world).
"""

from __future__ import annotations

from megatron_ext.extension import DryRunPart
from megatron_ext.methods.gnmr.decisions import GnmrConfig
from megatron_ext.methods.gnmr.memory import (ActivationLayout, peak_extra_bytes, site_bits,
                                              unit_extra_bytes)
from megatron_ext.methods.gnmr.units import unit_ids, unit_layer, unit_sites
from megatron_ext.precision.controller import PlanController
from megatron_ext.precision.dry_run import assumed_plan, micro_batch_shape
from megatron_ext.training.dry_run.estimates import in_flight

MIB = 2.0 ** 20


def stage_bounds(config: GnmrConfig, plan, shape, layout, stages) -> list:
    """Per stage of ``stages`` (the dry run's ``StageParams``), eq. 62's
    :class:`~.memory.MemoryBound` for the units of that stage under ``plan``; ``shape`` is
    the run's ``ModelShape`` of one micro-batch, ``layout`` the dry run's ``Layout``."""
    native = 16 if layout.bf16 else 32
    acts = ActivationLayout(layout.seq * layout.micro_batch, layout.tp, layout.sequence_parallel)
    units = unit_ids(shape.num_layers, config.granularity)
    budget = config.budget(len(units))
    bounds = []
    for stage in stages:
        extras = []
        for unit in (u for u in units if unit_layer(u) in stage.layers):
            bits = {sid: site_bits(plan.formats(sid), config.high, native)
                    for sid in unit_sites(unit)}
            extras.append(unit_extra_bytes(shape, acts, unit, bits))
        held = min(in_flight(stage.stage, layout), layout.micro_batches)
        bounds.append(peak_extra_bytes(extras, budget, held))
    return bounds


def estimate(config: GnmrConfig | None, plans: PlanController, args, context
             ) -> DryRunPart | None:
    """GNMR's part of the report (module docstring); None without ``--gnmr``."""
    if config is None:
        return None
    shape = micro_batch_shape(args, context)
    plan = assumed_plan(args, plans, shape)
    bounds = stage_bounds(config, plan, shape, context.layout, context.stages)
    units = len(unit_ids(args.num_layers, config.granularity))
    budget = config.budget(units)
    per_stage = ", ".join(f"{b.topk / MIB:.1f}" for b in bounds)
    return DryRunPart(
        columns=("GNMR +MiB",),
        cells=tuple((f"{b.topk / MIB:.1f}",) for b in bounds),
        stage_json=tuple({"gnmr_extra_bytes": b.topk, "gnmr_extra_bytes_loose": b.loose}
                         for b in bounds),
        lines=(f"GNMR: {units} units ({config.granularity}), at most {budget} promoted "
               f"(maxO); App. D peak extra activation memory per GPU [{per_stage}] MiB by "
               f"stage (eq. 62); one float64 all-reduce of {8 * units:,} B per step",),
        notes=("GNMR's bound assumes kernels that keep x quantized for wgrad; the activation "
               "estimate counts 16-bit activations, which already hold a promoted x, so the "
               "bound is not added to the memory total",),
        json={"gnmr": {"units": units, "granularity": config.granularity, "max_promoted": budget,
                       "allreduce_bytes": 8 * units}})
