"""The dry-run seam: what the dry run tells extensions, and how their parts join the report.

The dry run itself knows the layout, the stages megatron-core built, their parameters, memory
and the pipeline bubble. Everything that depends on a feature comes from the feature's
``Extension.dry_run_estimate(args, context)``, which returns a
:class:`~megatron_ext.extension.DryRunPart` (or None): the precision platform gives the
per-stage linear FLOPs, FP4 share and times under the plan the run would start with (its cost
model, ``megatron_ext/precision/dry_run.py``); SNIP gives its ILP solved for this shape and
the sizes of a refresh (``megatron_ext/methods/snip/dry_run.py``). Without an extension that
gives times, the report has no time estimate: the cost model belongs to the precision
platform, which training does not import.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.extension import DryRunPart, Extension, StageTimes
from megatron_ext.training.dry_run.estimates import Layout, in_flight
from megatron_ext.training.dry_run.meta import StageParams


@dataclass(frozen=True)
class DryRunContext:
    """What an extension's ``dry_run_estimate(args, context)`` learns besides the flags (the
    model's dimensions are the flags: ``args.hidden_size``, ``args.num_layers`` ...)."""

    layout: Layout
    """The parallel layout and micro-batch shape (TP, PP, DP, VP, micro-batches, ``b``, ``s``)."""
    stages: tuple[StageParams, ...]
    """Per pipeline stage, as megatron-core built it: its global layers, parameter counts."""
    vocab: int
    """The padded vocabulary (the output layer's width)."""
    bf16_flops_per_s: float
    """Dense BF16 rate of one GPU the times should assume (``--dry-run-bf16-tflops``)."""

    @property
    def layer_stages(self) -> list[int]:
        """Pipeline stage of every global layer (virtual chunks included)."""
        stage_of = {layer: s.stage for s in self.stages for layer in s.layers}
        return [stage_of[layer] for layer in range(len(stage_of))]

    def held(self, stage: int) -> float:
        """Micro-batches of its layers ``stage`` holds at the schedule's peak (the 1F1B
        warm-up; with virtual stages, chunk-micro-batches over the chunks per stage): how
        many times it keeps what one micro-batch keeps."""
        return in_flight(stage, self.layout) / self.layout.vp


def collect(extensions: list[Extension], args, context: DryRunContext,
            reserved: tuple[str, ...] = ()) -> dict[str, DryRunPart]:
    """Every extension's part, by extension name in list order; ``ValueError`` for a part
    whose per-stage fields do not have one entry per stage, two parts that give times (or
    moments), or a
    JSON key given twice (or one of the report's own, ``reserved``)."""
    parts = {}
    for ext in extensions:
        part = ext.dry_run_estimate(args, context) if ext.dry_run_estimate else None
        if part is not None:
            _check(ext.name, part, len(context.stages))
            parts[ext.name] = part
    for what, given in (("stage times", lambda p: p.times is not None),
                        ("optimizer moments", lambda p: bool(p.moments))):
        giving = [name for name, part in parts.items() if given(part)]
        if len(giving) > 1:
            raise ValueError(f"several extensions estimate {what}: {', '.join(giving)}")
    keys = [*reserved, *(key for part in parts.values() for key in part.json)]
    if len(set(keys)) != len(keys):
        raise ValueError(f"dry-run parts give a JSON key twice: {sorted(keys)}")
    return parts


def _check(name: str, part: DryRunPart, stages: int) -> None:
    sized = {"cells": part.cells, "stage_json": part.stage_json, "memory": part.memory,
             "moments": part.moments,
             "times": part.times.seconds if part.times else ()}
    for field, values in sized.items():
        given = bool(values) or (field == "cells" and bool(part.columns))
        if given and len(values) != stages:
            raise ValueError(f"dry-run part of {name}: {field} has {len(values)} entries for "
                             f"{stages} stages")
    if any(len(row) != len(part.columns) for row in part.cells):
        raise ValueError(f"dry-run part of {name}: a stage's cells do not match its "
                         f"{len(part.columns)} columns")


def stage_times(parts: dict[str, DryRunPart]) -> StageTimes | None:
    """The one part's times, or None."""
    return next((p.times for p in parts.values() if p.times is not None), None)


def moments(parts: dict[str, DryRunPart]) -> DryRunPart | None:
    """The one part that gives the optimizer's moments, or None (FP32 Adam's)."""
    return next((p for p in parts.values() if p.moments), None)


def extra_memory(parts: dict[str, DryRunPart], stage: int) -> float:
    """Bytes the parts add to one GPU of ``stage``."""
    return float(sum(p.memory[stage] for p in parts.values() if p.memory))
