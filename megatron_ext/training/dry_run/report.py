"""The dry-run report: one dataclass per part, a text table for people, JSON for tools."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from megatron_ext.training.dry_run.estimates import GIB, Memory
from megatron_ext.training.dry_run.meta import StageParams
from megatron_ext.training.dry_run.snip import IlpRun, SnipSizes


@dataclass(frozen=True)
class StageReport:
    """One pipeline stage, as one GPU of it sees it."""

    params: StageParams
    """Parameter counts from the stage's megatron modules (built on the meta device)."""
    sites: int
    """Linear GEMM sites (4 per layer)."""
    linear_flops: float
    """Linear-site FLOPs of one training step, all of the stage's GPUs together."""
    fp4_fraction: float
    """FP4 share of those FLOPs under the plan the times use."""
    memory: Memory
    """Estimated memory of one GPU (bytes)."""
    in_flight: int
    """Chunk-micro-batches whose activations the GPU holds at the schedule's peak."""
    seconds: float
    """Estimated forward + backward time of one micro-batch on one GPU (peak rate)."""


@dataclass(frozen=True)
class DryRunReport:
    """Everything ``--dry-run`` found out about a job without starting it."""

    header: str
    """One line: model, layout, batch."""
    total_params: int
    """Distinct parameters of the model (tied copies counted once)."""
    stages: list[StageReport]
    """Per pipeline stage."""
    plan: str
    """The precision plan the times and FP4 fractions assume."""
    bubble: float
    """Pipeline bubble fraction of a step."""
    step_seconds: float
    """Estimated step time (slowest stage, schedule, peak rate)."""
    tokens_per_second: float
    """Global batch tokens / step time."""
    gpu_bytes: float
    """Memory of one GPU (``--dry-run-gpu-memory-gib``) the stages are compared with."""
    build_seconds: float
    """Wall seconds to build every stage on the meta device."""
    snip: SnipSizes
    """SNIP's per-refresh statistics and collectives."""
    ilp: IlpRun
    """SNIP's ILP solved for this shape with synthetic statistics."""
    notes: list[str]
    """Assumptions and formulas, one line each."""

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for stage, report in zip(out["stages"], self.stages):
            stage["memory"]["total"] = report.memory.total
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _layers(layers: tuple[int, ...]) -> str:
    if not layers:
        return "-"
    runs, start = [], layers[0]
    for prev, cur in zip(layers, layers[1:] + (None,)):
        if cur != prev + 1:
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = cur
    return ",".join(runs)


COLUMNS = ("stage", "layers", "params/GPU", "params", "sites", "lin PFLOP", "FP4",
           "weights", "grads", "optim", "activ", "total GiB", "mb", "t/mb ms")
"""Table columns: memory in GiB per GPU; PFLOP per step for the whole stage."""


def _row(s: StageReport, limit: float) -> list[str]:
    m = s.memory
    over = " !" if m.total > limit else ""
    return [str(s.params.stage), _layers(s.params.layers), _count(s.params.per_gpu),
            _count(s.params.distinct), str(s.sites), f"{s.linear_flops / 1e15:.1f}",
            f"{100 * s.fp4_fraction:.0f}%", *(f"{x / GIB:.1f}" for x in
            (m.weights, m.grads, m.optimizer, m.activations)), f"{m.total / GIB:.1f}{over}",
            str(s.in_flight), f"{1e3 * s.seconds:.3g}"]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _summary(r: DryRunReport) -> list[str]:
    over = [s.params.stage for s in r.stages if s.memory.total > r.gpu_bytes]
    fit = (f"stages {over} exceed {r.gpu_bytes / GIB:.0f} GiB (marked !)" if over
           else f"every stage fits in {r.gpu_bytes / GIB:.0f} GiB")
    ilp, snip = r.ilp, r.snip
    return [
        f"parameters: {r.total_params:,} ({_count(r.total_params)}; {len(r.stages)} stages "
        f"built on the meta device in {r.build_seconds:.1f} s); memory: {fit}",
        f"time (plan {r.plan}): step {r.step_seconds:.2f} s, bubble {100 * r.bubble:.2f}%, "
        f"{r.tokens_per_second:,.0f} tokens/s",
        f"SNIP refresh: {snip.sites} sites x {snip.options} options; statistics per GPU "
        f"{snip.stage_scalars[0] * 4:,} B (TP all-reduce, DP all-reduce of that size), PP "
        f"gather {snip.gathered_bytes:,} B to the solver, plan broadcast {snip.plan_bytes:,} B",
        f"SNIP ILP (synthetic statistics, budget {ilp.budget:g}, stage balance "
        f"{ilp.stage_balance}): {ilp.status} in {ilp.solve_time:.2f} s, {ilp.variables:,} "
        f"variables ({ilp.pruned:,} pruned), FP4 {ilp.fp4_fraction:.3f}, per stage "
        f"[{', '.join(f'{f:.2f}' for f in ilp.stage_fp4_fraction)}], objective "
        f"{ilp.objective:.1f}",
    ]


def format_report(r: DryRunReport) -> str:
    """The human-readable report: header, stage table, summary, assumptions."""
    rows = [list(COLUMNS)] + [_row(s, r.gpu_bytes) for s in r.stages]
    lines = [r.header, *_table(rows), *_summary(r)]
    return "\n".join(lines + [f"  note: {n}" for n in r.notes])
