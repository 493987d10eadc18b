"""The dry-run report: one dataclass per part, a text table for people, JSON for tools."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from megatron_ext.extension import DryRunPart, StageTimes
from megatron_ext.training.dry_run.estimates import GIB, Memory
from megatron_ext.training.dry_run.meta import StageParams
from megatron_ext.training.dry_run.parts import stage_times


@dataclass(frozen=True)
class StageReport:
    """One pipeline stage, as one GPU of it sees it."""

    params: StageParams
    """Parameter counts from the stage's megatron modules (built on the meta device)."""
    memory: Memory
    """Estimated memory of one GPU (bytes)."""
    in_flight: int
    """Chunk-micro-batches whose activations the GPU holds at the schedule's peak."""
    seconds: float | None
    """Estimated forward + backward time of one micro-batch on one GPU (peak rate), or None
    without an extension that estimates times."""


@dataclass(frozen=True)
class DryRunReport:
    """Everything ``--dry-run`` found out about a job without starting it."""

    header: str
    """One line: model, layout, batch."""
    total_params: int
    """Distinct parameters of the model (tied copies counted once)."""
    stages: list[StageReport]
    """Per pipeline stage."""
    bubble: float
    """Pipeline bubble fraction of a step."""
    step_seconds: float | None
    """Estimated step time (slowest stage, schedule, peak rate), or None without times."""
    tokens_per_second: float | None
    """Global batch tokens / step time, or None without times."""
    gpu_bytes: float
    """Memory of one GPU (``--dry-run-gpu-memory-gib``) the stages are compared with."""
    build_seconds: float
    """Wall seconds to build every stage on the meta device."""
    notes: list[str]
    """Assumptions and formulas, one line each."""
    parts: dict[str, DryRunPart]
    """What each extension added, by extension name (columns, lines, times, JSON)."""

    @property
    def times(self) -> StageTimes | None:
        """The per-stage times of the one part that gives them, or None."""
        return stage_times(self.parts)

    def to_dict(self) -> dict:
        """The report's numbers, each part's ``stage_json`` and ``json`` merged in."""
        stages = []
        for k, s in enumerate(self.stages):
            stage = {"params": dataclasses.asdict(s.params)}
            for part in self.parts.values():
                stage.update(part.stage_json[k] if part.stage_json else {})
            memory = {**dataclasses.asdict(s.memory), "total": s.memory.total}
            stages.append({**stage, "memory": memory, "in_flight": s.in_flight,
                           "seconds": s.seconds})
        out = {"header": self.header, "total_params": self.total_params, "stages": stages,
               "bubble": self.bubble, "step_seconds": self.step_seconds,
               "tokens_per_second": self.tokens_per_second, "gpu_bytes": self.gpu_bytes,
               "build_seconds": self.build_seconds}
        for part in self.parts.values():
            out.update(part.json)
        return {**out, "notes": self.notes}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


REPORT_KEYS = ("header", "total_params", "stages", "bubble", "step_seconds",
               "tokens_per_second", "gpu_bytes", "build_seconds", "notes")
"""Top-level JSON keys of the report itself (a part may not add them)."""


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


def _has_extra(r: DryRunReport) -> bool:
    return any(s.memory.extra for s in r.stages)


def _columns(r: DryRunReport) -> list[str]:
    """Table columns: memory in GiB per GPU; parts' columns after the parameter counts."""
    extra = ["extra"] if _has_extra(r) else []
    return ["stage", "layers", "params/GPU", "params",
            *(c for part in r.parts.values() for c in part.columns),
            "weights", "grads", "optim", "activ", *extra, "total GiB", "mb",
            *(["t/mb ms"] if r.times else [])]


def _row(r: DryRunReport, k: int) -> list[str]:
    s, limit = r.stages[k], r.gpu_bytes
    m = s.memory
    over = " !" if m.total > limit else ""
    extra = [m.extra] if _has_extra(r) else []
    return [str(s.params.stage), _layers(s.params.layers), _count(s.params.per_gpu),
            _count(s.params.distinct),
            *(c for part in r.parts.values() if part.columns for c in part.cells[k]),
            *(f"{x / GIB:.1f}" for x in (m.weights, m.grads, m.optimizer, m.activations, *extra)),
            f"{m.total / GIB:.1f}{over}", str(s.in_flight),
            *([f"{1e3 * s.seconds:.3g}"] if r.times else [])]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _time_line(r: DryRunReport) -> str:
    bubble = f"bubble {100 * r.bubble:.2f}%"
    if r.times is None:
        return (f"time: no estimate (no extension estimates stage times; the precision "
                f"platform's does), {bubble}")
    return (f"time ({r.times.basis}): step {r.step_seconds:.2f} s, {bubble}, "
            f"{r.tokens_per_second:,.0f} tokens/s")


def _summary(r: DryRunReport) -> list[str]:
    over = [s.params.stage for s in r.stages if s.memory.total > r.gpu_bytes]
    fit = (f"stages {over} exceed {r.gpu_bytes / GIB:.0f} GiB (marked !)" if over
           else f"every stage fits in {r.gpu_bytes / GIB:.0f} GiB")
    return [
        f"parameters: {r.total_params:,} ({_count(r.total_params)}; {len(r.stages)} stages "
        f"built on the meta device in {r.build_seconds:.1f} s); memory: {fit}",
        _time_line(r), *(line for part in r.parts.values() for line in part.lines)]


def format_report(r: DryRunReport) -> str:
    """The human-readable report: header, stage table, summary, assumptions."""
    rows = [_columns(r)] + [_row(r, k) for k in range(len(r.stages))]
    lines = [r.header, *_table(rows), *_summary(r)]
    return "\n".join(lines + [f"  note: {n}" for n in r.notes])
