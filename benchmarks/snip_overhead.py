"""Time cost of SNIP refreshes in a training run, from its metrics (not a test).

    python benchmarks/snip_overhead.py runs/snip_overhead          # analyse a finished run
    python benchmarks/snip_overhead.py runs/snip_overhead --train  # make the run, then analyse

A refresh at step ``s`` (:mod:`megatron_ext.methods.snip.extension`) trains step ``s+1``,
then runs SNIP's steps 1-3 on that step's batch and the weights before it (the record of step
``s+1`` carries their time, ``snip_collect_s``, and ``snip_refresh: s``), and starts the divergence analysis and ILP in
a background thread that must be done before step ``s+D+1`` (``D`` = ``--snip-apply-lag``).
From the per-step ``step_time_s`` (the run needs ``--log-interval 1``) this reports

* the **refresh time** in units of the median normal step, and amortised over the refresh
  interval (the share of training time the refreshes add);
* the **slow-down of the steps during the background analysis**, steps ``s+2 .. s+D``,
  against the normal steps before that refresh under the same plan (steps after the previous
  plan switch), per refresh and pooled (target < 5 %), step by step (``s+k``: the median over
  refreshes; the later steps, which the analysis no longer overlaps, show the noise), and
  the extra seconds those steps took;
* the analysis + ILP seconds when the run's ``train.log`` holds the planner's lines.

"Normal" steps are all others except the first ``--skip`` (warm-up), the refresh steps
``s+1`` and the background steps. ``step_time_s`` covers the training step only: the
collection (``snip_collect_s``), the AdamW read and statistics reduction after step ``s+1``
(``snip_reduce_s``) and the plan switch before ``s+D+1`` (``snip_apply_s``, waiting for the
worker included) are reported beside it. ``--train`` makes the run with :data:`TRAIN_FLAGS` through
``benchmarks/precision_quality.py``'s :func:`train` (a longer lag and more refreshes than the
quality grid, to have more background steps to compare).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from precision_quality import read_metrics, report_main

TRAIN_FLAGS = ["--precision", "snip", "--snip-budget", "0.5", "--snip-start", "20",
               "--snip-interval", "20", "--snip-apply-lag", "5", "--train-iters", "200",
               "--lr", "1e-3", "--min-lr", "1e-4", "--seed", "1234", "--log-interval", "1",
               "--eval-iters", "0"]
"""The run ``--train`` makes: 9 refreshes (steps 20, 40, ..., 180), 4 background steps each."""
WORKER_LINE = re.compile(r"plan of the step-(\d+) refresh \(analysis \+ ILP ([0-9.]+) s")


@dataclass
class Refresh:
    step: int
    """``s``: the refresh happened before step s+1 and was applied before step s+D+1."""
    collect_s: float
    after: list[float]
    """Step times of steps s+1 .. s+D: the refresh step, then the background steps."""
    before: list[float]
    """Step times of the normal steps since the previous plan switch (same plan)."""
    worker_s: float | None = None

    @property
    def background(self) -> list[float]:
        """Step times of steps s+2 .. s+D, while the analysis may run."""
        return self.after[1:]

    @property
    def base(self) -> float:
        return statistics.median(self.before)

    @property
    def ratio(self) -> float:
        return statistics.median(self.background) / self.base

    @property
    def extra_s(self) -> float:
        """Seconds the background steps took beyond the same-plan median."""
        return sum(t - self.base for t in self.background)


def step_times(records: list[dict]) -> dict[int, float]:
    """Step -> step_time_s (the last record of a step wins)."""
    return {r["step"]: r["step_time_s"] for r in records if "step_time_s" in r}


def refreshes(records: list[dict]) -> dict[int, float]:
    """Refresh step s -> collection seconds (steps 1-3), from the records of steps s+1."""
    return {r["snip_refresh"]: r.get("snip_collect_s", float("nan"))
            for r in records if "snip_refresh" in r}


def side_seconds(records: list[dict], key: str) -> list[float]:
    """Every value of a SNIP timing outside ``step_time_s`` (``snip_reduce_s``, ...)."""
    return [r[key] for r in records if key in r]


def worker_seconds(log: Path) -> dict[int, float]:
    """Refresh step -> background analysis + ILP seconds, from the run's printed lines."""
    if not log.exists():
        return {}
    return {int(s): float(t) for s, t in WORKER_LINE.findall(log.read_text(encoding="utf-8"))}


def classify(times: dict[int, float], refresh_steps, lag: int, skip: int) -> dict[int, str]:
    """Step -> ``warm-up``, ``refresh`` (s+1), ``background`` (s+2..s+D) or ``normal``."""
    kind = {t: "normal" for t in times}
    for t in times:
        if t <= skip:
            kind[t] = "warm-up"
    for s in refresh_steps:
        for t in range(s + 1, s + lag + 1):
            if t in kind:
                kind[t] = "refresh" if t == s + 1 else "background"
    return kind


def analyse(records: list[dict], lag: int, skip: int, workers: dict[int, float]) -> list[Refresh]:
    times, collected = step_times(records), refreshes(records)
    kind = classify(times, collected, lag, skip)
    out, plan_start = [], 0
    for s in sorted(collected):
        before = [times[t] for t in range(plan_start + 1, s + 1) if kind.get(t) == "normal"]
        after = [times.get(t) for t in range(s + 1, s + lag + 1)]
        if before and lag >= 2 and None not in after:
            out.append(Refresh(s, collected[s], after, before, workers.get(s)))
        plan_start = s + lag  # the new plan runs from step s+D+1 on
    return out


def normal_median(records: list[dict], lag: int, skip: int) -> float:
    times = step_times(records)
    kind = classify(times, refreshes(records), lag, skip)
    return statistics.median(t for step, t in times.items() if kind[step] == "normal")


def report(run_dir: Path, skip: int) -> str:
    args = json.loads((run_dir / "args.json").read_text())
    lag, interval = args["snip_apply_lag"], args["snip_interval"]
    records = read_metrics(run_dir)
    found = analyse(records, lag, skip, worker_seconds(run_dir / "train.log"))
    if not found:
        raise SystemExit(f"{run_dir}: no refresh with step times before and after it "
                         "(needs --log-interval 1 and --snip-apply-lag >= 2)")
    unit = normal_median(records, lag, skip)
    head = (f"{run_dir}: {len(found)} refreshes, apply lag {lag}, interval {interval}, "
            f"median normal step {1e3 * unit:.0f} ms")
    columns = ("refresh step", "collect s", "collect / median step", "analysis + ILP s",
               "background steps", "their median ms", "same-plan steps before",
               "their median ms", "slow-down")
    lines = [head, "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in found:
        worker = f"{r.worker_s:.2f}" if r.worker_s is not None else "-"
        lines.append(f"| {r.step} | {r.collect_s:.2f} | {r.collect_s / unit:.1f} | {worker} | "
                     f"{len(r.background)} | {1e3 * statistics.median(r.background):.0f} | "
                     f"{len(r.before)} | {1e3 * statistics.median(r.before):.0f} | "
                     f"{100 * (r.ratio - 1):+.1f} % |")
    lines += ["", *by_offset(found), "", *summary(found, unit, interval)]
    for key, what in (("snip_reduce_s", "AdamW read + statistics all-reduce after step s+1"),
                      ("snip_apply_s", "plan switch before step s+D+1 (worker wait included)")):
        values = side_seconds(records, key)
        if values:
            med = statistics.median(values)
            lines.append(f"- {what}: median {med:.3f} s = {med / unit:.2f} normal steps "
                         f"({len(values)} times)")
    return "\n".join(lines) + "\n"


def by_offset(found: list[Refresh]) -> list[str]:
    """Median slow-down of step s+k (k = 1 .. D) against the same-plan steps before."""
    lag = len(found[0].after)
    cells = [statistics.median(r.after[k] / r.base for r in found) for k in range(lag)]
    return ["| step | " + " | ".join(f"s+{k + 1}" for k in range(lag)) + " |",
            "|---" * (lag + 1) + "|",
            "| median slow-down | " + " | ".join(f"{100 * (c - 1):+.1f} %" for c in cells) + " |",
            "", "(s+1 trains after the collection; the analysis starts after it.)"]


def summary(found: list[Refresh], unit: float, interval: int) -> list[str]:
    collect = statistics.median(r.collect_s for r in found)
    pooled = (statistics.median(t for r in found for t in r.background)
              / statistics.median(t for r in found for t in r.before))
    per = statistics.median(r.ratio for r in found)
    refresh = (f"- refresh (steps 1-3): median {collect:.2f} s = {collect / unit:.1f} normal "
               f"steps; every {interval} steps that adds "
               f"{100 * collect / (interval * unit):.1f} % to the training time")
    background = (f"- steps during the background analysis: median of the per-refresh "
                  f"slow-downs {100 * (per - 1):+.1f} %, pooled (all background steps vs all "
                  f"same-plan steps before) {100 * (pooled - 1):+.1f} % (target < 5 %)")
    extra = statistics.median(r.extra_s for r in found)
    extra_line = (f"- extra time of the background steps per refresh: median {extra:.3f} s = "
                  f"{extra / unit:.2f} normal steps")
    lines = [refresh, background, extra_line]
    workers = [r.worker_s for r in found if r.worker_s is not None]
    if workers:
        lines.append(f"- analysis + ILP in the background: median {statistics.median(workers):.2f}"
                     f" s = {statistics.median(workers) / unit:.2f} normal steps")
    return lines


if __name__ == "__main__":
    report_main(__doc__, TRAIN_FLAGS, report)
