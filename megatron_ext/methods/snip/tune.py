"""The precision budget tuner (``tools/tune_precision.py``): sweeps, stages, explanations.

Everything starts from a :class:`~megatron_ext.methods.snip.offline.Planning` (a refresh's saved
statistics as an ILP instance for one policy and pipeline layout) and is solved by
:func:`megatron_ext.methods.snip.ilp.solve`; this module only arranges the solves and reads the
solutions:

* **Pareto sweep** — one plan per budget ``E_t``, plus the *anchor*: the plan at ``E_t =
  0`` (the least Q, normally all FP8). Each point gets its FP4 fraction ``f``, quality loss
  ``Q`` (the objective) and step-time saving ``1 − max_k T_k / max_k T8_k``: ``T_k`` the
  plan's stage time (option times + fixed time, as in plan.json), ``T8_k`` the all-FP8 one
  (:func:`megatron_ext.methods.snip.ilp_arrays.stage_time_bound` at ``E_t = 0``). Optimal solves make
  ``Q`` non-decreasing in ``E_t`` (a plan feasible at a higher budget is feasible at a
  lower one).
* **Knee** — with points sorted by budget (anchor first, fallback plans left out), the
  marginal cost of point ``i`` is ``m_i = (Q_i − Q_{i−1}) / (f_i − f_{i−1})`` and the
  average cost ``ā = (Q_n − Q_0) / (f_n − f_0)`` over the whole sweep. The knee is the
  largest budget before the first point whose marginal cost exceeds ``2 ā``: up to it every
  step of extra FP4 costs at most twice the average rate, past it FP4 gets expensive. If no
  point exceeds ``2 ā`` the knee is the largest budget (no knee in range); if the first does,
  there is none (null).
* **Per-stage budgets** — stage ``k``'s sites are solved as their own one-stage problem
  with budget ``b_k``, a fraction of *that stage's* linear FLOPs (its fixed time kept), and
  the choices are joined. The joined solution's ``budget`` is the overall fraction the stage
  budgets add up to, ``Σ b_k F_k / F``, its ``stage_balance`` is ``"per-stage"``.
* **Stage table** — per stage its layers, linear FLOPs, FP4 fraction and estimated time;
  per micro-batch ``t_k = T_k / (m · D)`` (``m`` micro-batches, ``D`` data-parallel
  replicas: the problem's times are for the whole global batch), and the 1F1B pipeline of
  :mod:`megatron_ext.training.dry_run.estimates`: step ``(v·m + p − 1) · max_k t_k / v``,
  bubble ``(p − 1) / (v·m + p − 1)`` of it; the slowest stage is the bottleneck, and a
  stage's idle share is ``1 − m·t_k / step``.
* **Explain** — per site: the chosen option, its ΔL and ΔW (policy ``snip``), FLOP share and
  Q, and the *next-best* option: the least-Q option whose FP4 FLOPs differ from the
  chosen one's, with the change in Q and in the model's FP4 fraction it would bring.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

from megatron_ext.precision.cost import operand_class
from megatron_ext.sites import ROLES
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.methods.snip.divergence import divergences
from megatron_ext.methods.snip.ilp import STATUSES, Solution, SolverConfig, solve
from megatron_ext.methods.snip.ilp_arrays import stage_time_bound
from megatron_ext.methods.snip.offline import Planning
from megatron_ext.methods.snip.problem import Problem
from megatron_ext.training.dry_run import estimates
from megatron_ext.training.layer_impl import resolve_transformer_impl

KNEE_FACTOR = 2.0
"""The knee is the last budget whose marginal Q per FP4 fraction is <= this x the average."""
_EPS = 1e-12


# ---------------------------------------------------------------- sweep and knee


def feasible(solution: Solution) -> bool:
    """A solver plan (not the safe fallback)."""
    return not solution.fallback


def step_time_saving(problem: Problem, solution: Solution) -> float:
    """1 − slowest stage time / slowest stage time of the all-FP8 plan."""
    return 1.0 - max(solution.stage_time) / stage_time_bound(problem, 0.0)


def sweep(problem: Problem, budgets: list[float], mode: str,
          config: SolverConfig) -> list[Solution]:
    """One solution per budget, in the order given."""
    return [solve(problem, b, mode, config) for b in budgets]


def _slope(a: Solution, b: Solution) -> float:
    df, dq = b.fp4_fraction - a.fp4_fraction, b.objective - a.objective
    if df <= _EPS:
        return 0.0 if dq <= _EPS * max(1.0, abs(b.objective)) else math.inf
    return dq / df


def knee_index(curve: list[Solution], factor: float = KNEE_FACTOR) -> int | None:
    """Index in ``curve`` (anchor first, then by budget) of the knee (module docstring)."""
    if len(curve) < 2:
        return None
    average = _slope(curve[0], curve[-1])
    knee = None
    for i in range(1, len(curve)):
        if _slope(curve[i - 1], curve[i]) > factor * average + _EPS:
            break
        knee = i
    return knee


def pareto(problem: Problem, anchor: Solution, solutions: list[Solution]) -> dict:
    """The Pareto table (one row per budget, ascending) with marginal costs and the knee."""
    ordered = sorted(solutions, key=lambda s: s.budget)
    curve = [anchor] + [s for s in ordered if feasible(s)]
    knee = knee_index(curve)
    rows, previous = [], anchor
    for s in ordered:
        row = {"budget": s.budget, "status": s.status, "fp4_fraction": s.fp4_fraction,
               "objective": s.objective, "saving": step_time_saving(problem, s),
               "marginal": None, "knee": knee is not None and s is curve[knee]}
        if feasible(s):
            row["marginal"] = _finite(_slope(previous, s))
            previous = s
        rows.append(row)
    return {"anchor": {"budget": 0.0, "status": anchor.status,
                       "fp4_fraction": anchor.fp4_fraction, "objective": anchor.objective,
                       "saving": step_time_saving(problem, anchor)},
            "average_marginal": _finite(_slope(curve[0], curve[-1])) if len(curve) > 1
            else None,
            "knee": curve[knee].budget if knee is not None else None,
            "knee_rule": f"largest budget before the marginal Q per unit FP4 fraction first "
                         f"exceeds {KNEE_FACTOR:g}x its average over the sweep",
            "points": rows}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------- per-stage budgets


def stage_problem(problem: Problem, stage: int) -> Problem:
    """Stage ``stage``'s sites as a one-stage problem (its fixed time kept)."""
    sites = tuple(replace(s, stage=0) for s in problem.sites if s.stage == stage)
    return Problem(sites, 1, (problem.stage_fixed_time[stage],),
                   meta={**problem.meta, "stage": stage})


def solve_per_stage(problem: Problem, budgets: list[float],
                    config: SolverConfig) -> Solution:
    """Every stage solved alone at its own budget (a fraction of its FLOPs), joined."""
    if len(budgets) != problem.num_stages:
        raise ValueError(f"--stage-budgets has {len(budgets)} value(s) for "
                         f"{problem.num_stages} pipeline stage(s)")
    parts = [stage_problem(problem, k) for k in range(problem.num_stages)]
    solutions = [solve(p, b, "none", config) for p, b in zip(parts, budgets)]
    return _join(problem, budgets, [p.total_flops for p in parts], solutions)


def _join(problem: Problem, budgets: list[float], flops: list[float],
          parts: list[Solution]) -> Solution:
    merged = {site: name for part in parts for site, name in part.choice.items()}
    total = sum(flops)
    gaps = [p.mip_gap for p in parts]
    message = "; ".join(f"stage {k}: {p.message}" for k, p in enumerate(parts) if p.message)
    return Solution(
        choice={s.site: merged[s.site] for s in problem.sites},
        objective=math.fsum(p.objective for p in parts),
        fp4_fraction=sum(p.fp4_fraction * f for p, f in zip(parts, flops)) / total,
        stage_fp4_fraction=[p.fp4_fraction for p in parts],
        stage_time=[p.stage_time[0] for p in parts], time_bound=None,
        status=max((p.status for p in parts), key=STATUSES.index),
        mip_gap=None if None in gaps else max(gaps),
        solve_time=sum(p.solve_time for p in parts),
        budget=sum(b * f for b, f in zip(budgets, flops)) / total,
        stage_balance="per-stage", pruned=sum(p.pruned for p in parts), message=message)


# ---------------------------------------------------------------- stage table


def default_microbatches(args: argparse.Namespace) -> int:
    """global batch / (micro batch x data-parallel size), as the run computed it."""
    return max(1, args.global_batch_size // (args.micro_batch_size * args.data_parallel))


def stage_table(planning: Planning, solution: Solution, microbatches: int) -> dict:
    """Per-stage rows and the 1F1B pipeline estimate (module docstring)."""
    problem = planning.problem
    layout = estimates.Layout.from_args(   # a SNIP run: the quantized linears, local layers
        argparse.Namespace(**{**vars(planning.args), "num_microbatches": microbatches}),
        resolve_transformer_impl(getattr(planning.args, "transformer_impl", "auto"), True,
                                 te_available=True))
    per_mb = [t / (microbatches * layout.dp) for t in solution.stage_time]
    step = estimates.step_time(per_mb, layout)
    bottleneck = max(range(problem.num_stages), key=lambda k: solution.stage_time[k])
    total = problem.total_flops
    rows = []
    for k in range(problem.num_stages):
        flops = math.fsum(s.flops for s in problem.sites if s.stage == k)
        rows.append({
            "stage": k, "layers": [i for i, st in enumerate(planning.layer_stage) if st == k],
            "linear_flops": flops, "flop_share": flops / total,
            "fp4_fraction": solution.stage_fp4_fraction[k], "time": solution.stage_time[k],
            "fixed_time": problem.stage_fixed_time[k], "time_per_microbatch": per_mb[k],
            "idle_fraction": 1.0 - microbatches * per_mb[k] / step,
            "bottleneck": k == bottleneck})
    return {"stages": rows, "saving": step_time_saving(problem, solution),
            "pipeline_stages": problem.num_stages,
            "num_microbatches": microbatches, "data_parallel": layout.dp,
            "virtual_stages": layout.vp, "step_time": step,
            "bubble_fraction": estimates.bubble_fraction(layout),
            "bubble_time": estimates.bubble_fraction(layout) * step, "bottleneck": bottleneck}


# ---------------------------------------------------------------- explain


def short_name(formats: SiteFormats) -> str:
    """The precision class of x, w and dy, e.g. ``fp4/fp4/fp8``."""
    return "/".join(operand_class(getattr(formats, r)) for r in ROLES)


def next_best(site, chosen: int) -> int | None:
    """Index of the least-q option of ``site`` whose FP4 FLOPs differ from the chosen's."""
    f = site.options[chosen].fp4_flops
    others = [j for j, o in enumerate(site.options)
              if not math.isclose(o.fp4_flops, f, rel_tol=1e-12, abs_tol=0.0)]
    return min(others, key=lambda j: site.options[j].q, default=None)


def explain(planning: Planning, solution: Solution) -> list[dict]:
    """Per site: chosen option, ΔL, ΔW, FLOP share, Q and the next-best option."""
    problem, options = planning.problem, planning.options
    table = None
    if planning.policy == "snip":
        r = planning.refresh
        table = divergences(r.sites, options, r.loss, r.hyper, *planning.weights)
    total = problem.total_flops
    out = []
    for i, site in enumerate(problem.sites):
        names = [o.name for o in site.options]
        j = names.index(solution.choice[site.site])
        row = {"site": site.site, "stage": site.stage, "flop_share": site.flops / total,
               **_option_entry(site, j, options, table[i] if table else None)}
        k = next_best(site, j)
        row["next"] = None if k is None else {
            **_option_entry(site, k, options, table[i] if table else None),
            "dq": site.options[k].q - site.options[j].q,
            "d_fp4_fraction": (site.options[k].fp4_flops - site.options[j].fp4_flops) / total}
        out.append(row)
    return out


def _option_entry(site, j: int, options: list[SiteFormats], row) -> dict:
    opt = site.options[j]
    return {"option": opt.name, "short": short_name(options[j]),
            "fp4_share": opt.fp4_flops / opt.flops, "q": opt.q,
            "dL": row[j].dL if row else None, "dW": row[j].dW if row else None}
