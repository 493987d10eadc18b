"""The results of a finished grid as one JSON-ready mapping (``OUT/results.json``).

Layout (seeds are JSON object keys, so strings)::

    {"version": 1,
     "grid": {"entry", "base_flags", "seeds", "reference", "group_by", "runs": {name: flags}},
     "runs": {name: {
         "flags": [...], "group": "0.5" | null, "rank": 1,
         "seeds": {"1234": {"val_loss", "train_iters", "fp4_flop_frac",
                            "fp4_flop_frac_mean", "gemm_time_vs_bf16", "mem_gib"}},
         "val_loss": {"mean", "se"},
         "fp4_flop_frac", "fp4_flop_frac_mean", "gemm_time_vs_bf16", "gemm_time_saving",
         "mem_gib",
         "vs_reference": {"diffs": {"1234": d}, "mean", "se", "t", "df", "p", "verdict",
                          "rel_pct"} | null}},
     "groups": [{"group": "0.5" | null, "ranking": [names, best first],
                 "margin": {"runner_up", "best", "mean", "se", "t", ...} | null,
                 "best_per_seed": {"1234": name}}],
     "draws": [{"family", "runs", "place": {"1234": k}, "permutation_p",
                "draws_minus_reference": {"diffs", "mean", "se", "t", ...}}]}

``fp4_flop_frac`` is the final plan's FP4 share of the linear-layer FLOPs, ``..._mean`` its
mean over the logged steps, ``gemm_time_vs_bf16`` the cost model's GEMM time relative to
all-BF16 (mean over the logged steps) and ``gemm_time_saving`` one minus it; all four are means
over the seeds. ``mem_gib`` is the run's peak memory (the largest logged ``mem_gib``), per seed
and the largest over the seeds (null where a run logged none). ``vs_reference`` is the paired
difference run - reference with its paired t test and verdict (:mod:`.stats`: "lower" /
"higher" at p < 0.05 with >= 5 seeds, else "not separable at n seeds" with the 95 % interval;
n/a with one seed), ``rel_pct`` its mean relative to the reference's mean loss; ``margin`` the
paired difference runner-up - best of a group (how clearly the best one leads) and
``best_per_seed`` the group's lowest loss on each seed (a tie: the first in config order).
``draws``: each family of random draws (``random_draws``: runs ``NAME.d<i>``) against the
reference: the reference's place among the draws per seed (how many score at most its loss),
the permutation p of :func:`.stats.place_among_draws` and the paired difference
mean(draws) - reference.
"""

from __future__ import annotations

from megatron_ext.compare.grid import Grid, RunSpec
from megatron_ext.compare.jobs import RunMetrics
import re

from megatron_ext.compare.stats import (DIRECTION_WORDS, Paired, mean, paired,
                                        place_among_draws, ranks, standard_error, verdict)

Metrics = dict[tuple[str, int], RunMetrics]
"""(run name, seed) -> the job's metrics."""


def losses(metrics: Metrics, name: str, seeds) -> dict[int, float]:
    """Seed -> final validation loss of run ``name``."""
    return {s: metrics[name, s].val_loss for s in seeds}


def _paired_json(p: Paired) -> dict:
    return {"diffs": {str(s): d for s, d in p.diffs.items()}, "mean": p.mean, "se": p.se,
            "t": p.t, "df": p.df, "p": p.p, "verdict": verdict(p, -1, DIRECTION_WORDS)}


def _seed_json(m: RunMetrics) -> dict:
    return {"val_loss": m.val_loss, "train_iters": m.train_iters, "fp4_flop_frac": m.fp4_final,
            "fp4_flop_frac_mean": m.fp4_mean, "gemm_time_vs_bf16": m.gemm_time_mean,
            "mem_gib": m.mem_gib}


def _peak(values: list[float | None]) -> float | None:
    """The largest of the seeds' peaks; None unless every seed has one."""
    return None if any(v is None for v in values) else max(values)


def _run_json(grid: Grid, run: RunSpec, metrics: Metrics) -> dict:
    per_seed = [metrics[run.name, s] for s in grid.seeds]
    values = [m.val_loss for m in per_seed]
    time = mean([m.gemm_time_mean for m in per_seed])
    out = {"flags": list(run.flags), "group": grid.group_of(run),
           "seeds": {str(s): _seed_json(m) for s, m in zip(grid.seeds, per_seed)},
           "val_loss": {"mean": mean(values), "se": standard_error(values)},
           "fp4_flop_frac": mean([m.fp4_final for m in per_seed]),
           "fp4_flop_frac_mean": mean([m.fp4_mean for m in per_seed]),
           "gemm_time_vs_bf16": time, "gemm_time_saving": 1.0 - time,
           "mem_gib": _peak([m.mem_gib for m in per_seed]), "vs_reference": None}
    if grid.reference is not None and run.name != grid.reference:
        ref = losses(metrics, grid.reference, grid.seeds)
        diff = paired(losses(metrics, run.name, grid.seeds), ref)
        out["vs_reference"] = {**_paired_json(diff),
                               "rel_pct": 100.0 * diff.mean / mean(list(ref.values()))}
    return out


def _groups(grid: Grid, runs: dict, metrics: Metrics) -> list[dict]:
    """Rank runs within each group (first-seen order of the groups); sets ``runs[n]["rank"]``."""
    members: dict[str | None, list[str]] = {}
    for run in grid.runs:
        members.setdefault(grid.group_of(run), []).append(run.name)
    groups = []
    for group, names in members.items():
        rank = ranks({n: runs[n]["val_loss"]["mean"] for n in names})
        for name in names:
            runs[name]["rank"] = rank[name]
        ranking = sorted(names, key=lambda n: (rank[n], names.index(n)))
        margin = None
        if len(ranking) > 1:
            best, second = ranking[:2]
            diff = paired(losses(metrics, second, grid.seeds), losses(metrics, best, grid.seeds))
            margin = {"runner_up": second, "best": best, **_paired_json(diff)}
        best = {str(s): min(names, key=lambda n: metrics[n, s].val_loss) for s in grid.seeds}
        groups.append({"group": group, "ranking": ranking, "margin": margin,
                       "best_per_seed": best})
    return groups


DRAW_NAME = re.compile(r"(.+)\.d(\d+)")
"""A run made by ``random_draws``: ``NAME.d<i>``."""


def _draws(grid: Grid, metrics: Metrics) -> list[dict]:
    """Each family of random draws against the reference: its place per seed (draws scoring
    at most the reference), the permutation p, and mean(draws) - reference paired."""
    families: dict[str, list[str]] = {}
    for run in grid.runs:
        match = DRAW_NAME.fullmatch(run.name)
        if match:
            families.setdefault(match.group(1), []).append(run.name)
    if grid.reference is None:
        return []
    ref = losses(metrics, grid.reference, grid.seeds)
    out = []
    for family, names in families.items():
        per_seed = {s: [metrics[n, s].val_loss for n in names] for s in grid.seeds}
        place, p = place_among_draws(ref, per_seed)
        diff = paired({s: mean(v) for s, v in per_seed.items()}, ref)
        out.append({"family": family, "runs": names, "place": {str(s): k for s, k in
                                                               place.items()},
                    "permutation_p": p, "draws_minus_reference": _paired_json(diff)})
    return out


def grid_json(grid: Grid) -> dict:
    """The grid as given (flags as lists)."""
    return {"entry": grid.entry, "base_flags": list(grid.base_flags), "seeds": list(grid.seeds),
            "reference": grid.reference, "group_by": grid.group_by,
            "runs": {r.name: list(r.flags) for r in grid.runs}}


def collect(grid: Grid, metrics: Metrics) -> dict:
    """The results mapping of a grid whose every job finished."""
    runs = {run.name: _run_json(grid, run, metrics) for run in grid.runs}
    groups = _groups(grid, runs, metrics)
    return {"version": 1, "grid": grid_json(grid), "runs": runs, "groups": groups,
            "draws": _draws(grid, metrics)}
