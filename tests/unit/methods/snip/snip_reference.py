"""Independent references for the SNIP ILP tests: random problems, brute force, scipy.

Nothing here imports the solver's model code: the rows are written out again from the
formulas in docs/snip.md, so a mistake in ``megatron_ext.methods.snip.ilp_arrays`` cannot hide.
"""

from __future__ import annotations

import itertools

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from megatron_ext.methods.snip.problem import Option, Problem, Site

TOL = 1e-9
"""Row slack, in fractions of F (FLOP rows) and of B (time rows), as the solver's."""


def random_problem(rng: np.random.Generator, num_sites: int, num_options: int,
                   stages: int, integer_flops: bool = True, ties: bool = False) -> Problem:
    """Sites spread over ``stages`` in contiguous runs; option 0 of each site has no FP4;
    with ``ties`` the q are rounded to 0.1 so options and plans tie."""
    stage_of = np.sort(np.arange(num_sites) % stages)
    sites = []
    for i in range(num_sites):
        flops = float(rng.integers(1, 8) * 3000) if integer_flops else rng.uniform(1.0, 8.0)
        options = []
        for j in range(num_options):
            share = 0.0 if j == 0 else float(rng.choice([0.0, 1 / 3, 2 / 3, 1.0, rng.random()]))
            fp4 = round(share * flops) if integer_flops else share * flops
            q = float(rng.random() * (0.1 if j == 0 else 1.0))
            options.append(Option(f"o{j}", round(q, 1) if ties else q, fp4, flops,
                                  (flops - 0.5 * fp4) * rng.uniform(0.9, 1.1)))
        sites.append(Site(f"s{i}", int(stage_of[i]), tuple(options)))
    fixed = tuple(float(t) for t in rng.uniform(0.0, 2.0, stages))
    return Problem(tuple(sites), stages, fixed)


def time_bound(problem: Problem, budget: float) -> float:
    """B = max_k [c_k + Σ_{i in k} (t8_i − E_t (t8_i − t4_i))]."""
    total = list(problem.stage_fixed_time)
    for s in problem.sites:
        t8 = min(o.time for o in s.options if o.fp4_flops == 0)
        t4 = min(o.time for o in s.options)
        total[s.stage] += t8 - budget * (t8 - t4)
    return max(total)


def plan_rows(problem: Problem, plans: np.ndarray, budget: float, mode: str):
    """(objective, feasible) of each row of ``plans`` (option index per site)."""
    m, k = len(problem.sites), problem.num_stages
    total = sum(s.options[0].flops for s in problem.sites)
    q = np.zeros(len(plans))
    fp4 = np.zeros((len(plans), k))
    time = np.tile(np.asarray(problem.stage_fixed_time, dtype=float), (len(plans), 1))
    for i in range(m):
        site = problem.sites[i]
        pick = plans[:, i]
        q += np.array([o.q for o in site.options])[pick]
        fp4[:, site.stage] += np.array([o.fp4_flops for o in site.options])[pick]
        time[:, site.stage] += np.array([o.time for o in site.options])[pick]
    ok = fp4.sum(axis=1) / total >= budget - TOL
    if mode == "paper":
        ok &= (fp4 / total >= budget / k - TOL).all(axis=1)
    if mode == "time":
        ok &= (time / time_bound(problem, budget) <= 1 + TOL).all(axis=1)
    return q, ok


def brute_force(problem: Problem, budget: float, mode: str):
    """(least objective, its plan) over every combination, or (None, None)."""
    plans = np.array(list(itertools.product(*[range(len(s.options)) for s in problem.sites])))
    q, ok = plan_rows(problem, plans, budget, mode)
    if not ok.any():
        return None, None
    best = int(np.argmin(np.where(ok, q, np.inf)))
    return float(q[best]), plans[best]


def plan_indices(problem: Problem, choice: dict[str, str]) -> np.ndarray:
    return np.array([[[o.name for o in s.options].index(choice[s.site])
                      for s in problem.sites]])


def scipy_objective(problem: Problem, budget: float, mode: str) -> float | None:
    """Optimum from scipy.optimize.milp on the full model (one MIP, no pruning)."""
    rows, cols, vals, lo, hi = [], [], [], [], []
    total = sum(s.options[0].flops for s in problem.sites)
    k, col, cost = problem.num_stages, 0, []
    bound = time_bound(problem, budget) if mode == "time" else None
    m = len(problem.sites)
    for i, site in enumerate(problem.sites):
        for o in site.options:
            cost.append(o.q)
            entries = [(i, 1.0), (m, o.fp4_flops / total)]
            if mode == "paper":
                entries.append((m + 1 + site.stage, o.fp4_flops / total))
            if mode == "time":
                entries.append((m + 1 + site.stage, o.time / bound))
            for r, v in entries:
                rows.append(r)
                cols.append(col)
                vals.append(v)
            col += 1
    lo, hi = [1.0] * m + [budget], [1.0] * m + [np.inf]
    if mode == "paper":
        lo, hi = lo + [budget / k] * k, hi + [np.inf] * k
    if mode == "time":
        lo = lo + [-np.inf] * k
        hi = hi + [1 - c / bound for c in problem.stage_fixed_time]
    matrix = coo_array((vals, (rows, cols)), shape=(len(lo), col)).tocsr()
    result = milp(np.array(cost), constraints=LinearConstraint(matrix, lo, hi),
                  integrality=np.ones(col), bounds=Bounds(0, 1),
                  options={"mip_rel_gap": 1e-9, "time_limit": 60})
    return float(result.fun) if result.status == 0 else None
