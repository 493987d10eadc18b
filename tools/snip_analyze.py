#!/usr/bin/env python
"""Solve SNIP's precision-selection ILP for a saved problem or refresh and write the plan.

Reads a problem.json (sites, options with quality loss / FP4 FLOPs / FLOPs / time, pipeline
stages; the in-training planner writes one per refresh) — or, with --stats, re-runs steps 4-5
of a refresh from its saved statistics (stats.json and the run's args.json), for another
budget, policy or pipeline layout — solves the ILP of SNIP §5 with HiGHS and writes
plan.json: the chosen option per site, the objective, the FP4 fraction overall and per
stage, per-stage time, solver status, MIP gap and solve time. Schemas and the math:
docs/snip.md.

Examples:
    python tools/snip_analyze.py --problem problem.json --budget 0.75 --out plan.json
    python tools/snip_analyze.py --problem problem.json --budget 0.5 --stage-balance time \\
        --time-limit 5 --warm-start previous_plan.json --out plan.json
    python tools/snip_analyze.py --stats runs/x --budget 0.75 \\
        --pipeline-model-parallel-size 4 --out plan.json

Exit status: 0 when a plan was written (also the safe fallback plan: see its "status"),
2 on bad input (one "error: ..." line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.methods.snip import cli_args  # noqa: E402
from megatron_ext.methods.snip.ilp import solve  # noqa: E402
from megatron_ext.errors import UsageError  # noqa: E402
from megatron_ext.io import check_output, write_json_atomic  # noqa: E402
from megatron_ext.methods.snip.problem import Problem  # noqa: E402


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one ``error: ...`` line."""

    def error(self, message):
        fail(message)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0],
                epilog="Schemas, stage-balance modes and benchmark: docs/snip.md")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--problem", metavar="JSON",
                        help="problem.json to solve (sites, options, stages)")
    source.add_argument("--stats", metavar="PATH",
                        help="a refresh's stats.json, or a run directory (its latest "
                             "snip/step_*/stats.json): rebuild the problem from statistics")
    p.add_argument("--budget", required=True, type=cli_args.fraction, metavar="E_T",
                   help="target FP4 fraction of linear-layer FLOPs, in [0, 1]")
    p.add_argument("--out", required=True, metavar="JSON",
                   help="plan.json to write (atomically: temp file + rename)")
    p.add_argument("--warm-start", metavar="JSON",
                   help="a previous plan.json whose choices seed the search")
    cli_args.add_solver_arguments(p)
    cli_args.add_stats_arguments(p)
    args = p.parse_args(argv)
    if args.problem and (args.args or args.policy or cli_args.layout_given(args)):
        fail("--args, --policy and the layout flags need --stats")
    return args


def _warm_start(path: str | None) -> dict[str, str] | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            choice = json.load(f)["choice"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        fail(f"--warm-start {path}: not a readable plan.json ({err})")
    if not isinstance(choice, dict):
        fail(f"--warm-start {path}: 'choice' must map site -> option name")
    return choice


def load_problem(args: argparse.Namespace) -> tuple[Problem, dict, dict]:
    """(problem, the run's args.json or {}, where it came from) of --problem or --stats."""
    if args.problem:
        return Problem.load(args.problem), {}, {"problem": os.path.abspath(args.problem)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)  # megatron's import notes
        from megatron_ext.methods.snip import offline
    refresh = offline.load_refresh(args.stats, args.args)
    planning = offline.plan_problem(refresh, args.policy, cli_args.layout_of(args))
    return planning.problem, refresh.run_args, {
        "problem": None, "stats": os.path.abspath(refresh.stats_path),
        "args": os.path.abspath(refresh.args_path)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_output(args.out, "--out", kind="file")
        problem, run_args, source = load_problem(args)
        config = cli_args.solver_config(args, run_args)
    except (UsageError, ValueError) as err:
        fail(str(err))
    mode = cli_args.stage_balance_of(args, run_args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        solution = solve(problem, args.budget, mode, config, _warm_start(args.warm_start))
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    plan = {**solution.to_dict(), **source, "problem_meta": problem.meta}
    try:
        write_json_atomic(args.out, plan)
    except OSError as err:
        fail(f"cannot write {args.out}: {err.strerror}")
    stages = ", ".join(f"{f:.3f}" for f in solution.stage_fp4_fraction)
    print(f"{solution.status}: objective {solution.objective:.6g}, FP4 fraction "
          f"{solution.fp4_fraction:.4f} (stages {stages}), {solution.solve_time:.3f} s "
          f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
