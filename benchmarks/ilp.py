"""Solve time of the SNIP ILP (megatron_ext.methods.snip) beside plain scipy.optimize.milp (not a test).

Both solve the same llama3-70b-shaped synthetic problems (megatron_ext.methods.snip.synthetic:
4 sites x 8 options per layer, real FLOPs and times, random quality losses) at PP=8, for
each layer count, stage-balance mode and budget:

* ours  — ``megatron_ext.methods.snip.ilp.solve``: pruning, per-stage blocks, starting plans,
  HiGHS through highspy; timed end to end (problem in, plan out);
* refresh — ours on the same problem with every q perturbed by 5% (the next planner
  refresh), warm-started from the first plan;
* scipy — ``scipy.optimize.milp`` (HiGHS too) on the whole model as SNIP §6.1 used it: one
  MIP, every option, no start; only the ``milp`` call is timed (model built beforehand).

Both stop at the same relative gap (``--mip-gap``), so "optimal" means the same thing and
the objectives must agree to that gap. Times are medians of ``--repeat`` runs, wall clock
and CPU (the CPU column is steadier on a shared machine; the load average is printed).

    python benchmarks/ilp.py                           # 80/160/320 layers, paper + time
    python benchmarks/ilp.py --layers 80 --budgets 0.25 0.5 0.75 --repeat 5
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

try:
    from megatron_ext.methods.snip.ilp import SolverConfig, solve
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megatron_ext.methods.snip.ilp import SolverConfig, solve
from megatron_ext.methods.snip.ilp_arrays import stage_time_bound
from megatron_ext.methods.snip.problem import Problem
from megatron_ext.methods.snip.synthetic import synthetic_problem


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[80, 160, 320],
                   help="layer counts (default 80 160 320)")
    p.add_argument("--stages", type=int, default=8, help="pipeline stages (default 8)")
    p.add_argument("--modes", nargs="+", default=["paper", "time"],
                   choices=["paper", "time", "none"], help="stage-balance modes")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.75],
                   help="FP4 FLOP fractions E_t (default 0.5 0.75)")
    p.add_argument("--seed", type=int, default=0, help="synthetic problem seed")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per cell (median)")
    p.add_argument("--mip-gap", type=float, default=1e-6, help="relative gap, both solvers")
    p.add_argument("--time-limit", type=float, default=30.0, help="seconds, both solvers")
    p.add_argument("--no-scipy", action="store_true", help="skip the scipy.milp column")
    return p.parse_args(argv)


def scipy_model(problem: Problem, budget: float, mode: str):
    """(cost, A, lo, hi) of the whole ILP: rows [one per site | eq. 2 | one per stage]."""
    m, k, total = len(problem.sites), problem.num_stages, problem.total_flops
    bound = stage_time_bound(problem, budget) if mode == "time" else None
    rows, cols, vals, cost = [], [], [], []
    for i, site in enumerate(problem.sites):
        for o in site.options:
            entries = [(i, 1.0), (m, o.fp4_flops / total)]
            if mode == "paper":
                entries.append((m + 1 + site.stage, o.fp4_flops / total))
            elif mode == "time":
                entries.append((m + 1 + site.stage, o.time / bound))
            for r, v in entries:
                rows.append(r)
                cols.append(len(cost))
                vals.append(v)
            cost.append(o.q)
    lo, hi = [1.0] * m + [budget], [1.0] * m + [np.inf]
    if mode == "paper":
        lo, hi = lo + [budget / k] * k, hi + [np.inf] * k
    elif mode == "time":
        lo, hi = lo + [-np.inf] * k, hi + [1 - c / bound for c in problem.stage_fixed_time]
    matrix = coo_array((vals, (rows, cols)), shape=(len(lo), len(cost))).tocsr()
    return np.array(cost), matrix, np.array(lo), np.array(hi)


@contextlib.contextmanager
def c_stdout_silenced():
    """scipy's bundled HiGHS prints debug lines from C++ straight to fd 1: drop them."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def timed(fn, repeat: int):
    """(median wall s, median CPU s, last result)."""
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus), result


def perturbed(problem: Problem, seed: int) -> Problem:
    """The same problem with every q scaled by 1 + 5% noise (a later refresh)."""
    rng = np.random.default_rng(seed)
    sites = tuple(dataclasses.replace(s, options=tuple(
        dataclasses.replace(o, q=o.q * (1 + 0.05 * rng.standard_normal())) for o in s.options))
        for s in problem.sites)
    return Problem(sites, problem.num_stages, problem.stage_fixed_time, problem.meta)


def run_cell(args, layers: int, mode: str, budget: float) -> dict:
    problem = synthetic_problem(layers, stages=args.stages, seed=args.seed)
    config = SolverConfig(time_limit=args.time_limit, mip_gap=args.mip_gap)
    solve(problem, budget, mode, config)  # warm-up: imports, HiGHS's thread pool
    wall, cpu, ours = timed(lambda: solve(problem, budget, mode, config), args.repeat)
    later = perturbed(problem, args.seed + 1)
    r_wall, _, refresh = timed(lambda: solve(later, budget, mode, config, ours.choice),
                               args.repeat)
    row = {"layers": layers, "mode": mode, "budget": budget, "ours_wall": wall,
           "ours_cpu": cpu, "ours": ours.status, "objective": ours.objective,
           "refresh_wall": r_wall, "refresh": refresh.status}
    if not args.no_scipy:
        cost, matrix, lo, hi = scipy_model(problem, budget, mode)
        options = {"mip_rel_gap": args.mip_gap, "time_limit": args.time_limit}
        with c_stdout_silenced():
            s_wall, s_cpu, result = timed(lambda: milp(
                cost, constraints=LinearConstraint(matrix, lo, hi),
                integrality=np.ones(len(cost)), bounds=Bounds(0, 1), options=options),
                args.repeat)
        row.update(scipy_wall=s_wall, scipy_cpu=s_cpu,
                   scipy="optimal" if result.status == 0 else result.message.split(".")[0],
                   agree=abs(result.fun - ours.objective) / abs(result.fun)
                   if result.status == 0 else float("nan"))
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    warnings.simplefilter("ignore", RuntimeWarning)  # fallbacks show in the status column
    print(f"# SNIP ILP benchmark: llama3-70b shape, 4 sites x 8 options per layer, "
          f"PP={args.stages}, seed {args.seed}, mip gap {args.mip_gap}, median of "
          f"{args.repeat}; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start\n")
    head = ("| layers | mode | E_t | ours wall s | ours CPU s | status | refresh wall s "
            "| status |")
    rule = "|---|---|---|---|---|---|---|---|"
    if not args.no_scipy:
        head += " scipy.milp wall s | scipy CPU s | status | objective rel. diff |"
        rule += "---|---|---|---|"
    print(head)
    print(rule)
    for layers in args.layers:
        for mode in args.modes:
            for budget in args.budgets:
                r = run_cell(args, layers, mode, budget)
                line = (f"| {layers} | {mode} | {budget} | {r['ours_wall']:.3f} | "
                        f"{r['ours_cpu']:.3f} | {r['ours']} | {r['refresh_wall']:.3f} | "
                        f"{r['refresh']} |")
                if not args.no_scipy:
                    line += (f" {r['scipy_wall']:.3f} | {r['scipy_cpu']:.3f} | {r['scipy']} "
                             f"| {r['agree']:.1e} |")
                print(line, flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
