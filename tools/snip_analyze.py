#!/usr/bin/env python
"""Solve SNIP's precision-selection ILP for a saved problem and write the plan.

Reads a problem.json (sites, options with quality loss / FP4 FLOPs / FLOPs / time, pipeline
stages; the in-training planner writes one per refresh), solves the ILP of SNIP §5 with
HiGHS and writes plan.json: the chosen option per site, the objective, the FP4 fraction
overall and per stage, per-stage time, solver status, MIP gap and solve time. Schemas and
the math: docs/snip.md.

Examples:
    python tools/snip_analyze.py --problem problem.json --budget 0.75 --out plan.json
    python tools/snip_analyze.py --problem problem.json --budget 0.5 --stage-balance time \\
        --time-limit 5 --warm-start previous_plan.json --out plan.json

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

from megatron_ext.snip.ilp import STAGE_BALANCE, SolverConfig, solve  # noqa: E402
from megatron_ext.snip.problem import Problem, write_json_atomic  # noqa: E402


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one ``error: ...`` line."""

    def error(self, message):
        fail(message)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {value}")
    return value


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {kind.__name__}: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
        return value
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0],
                epilog="Schemas, stage-balance modes and benchmark: docs/snip.md")
    p.add_argument("--problem", required=True, metavar="JSON",
                   help="problem.json to solve (sites, options, stages)")
    p.add_argument("--budget", required=True, type=_fraction, metavar="E_T",
                   help="target FP4 fraction of linear-layer FLOPs, in [0, 1]")
    p.add_argument("--stage-balance", choices=STAGE_BALANCE, default="paper",
                   help="pipeline-stage rows: 'paper' = SNIP eq. 5 (every stage supplies "
                        "E_T/K of all FLOPs in FP4), 'time' = every stage's estimated time "
                        "within the bound B of docs/snip.md, 'none' = eq. 1-4 only "
                        "(default: paper)")
    p.add_argument("--out", required=True, metavar="JSON",
                   help="plan.json to write (atomically: temp file + rename)")
    p.add_argument("--time-limit", type=_positive(float), default=30.0, metavar="S",
                   help="seconds before the best plan found so far is taken (default 30)")
    p.add_argument("--mip-gap", type=float, default=1e-6, metavar="G",
                   help="relative gap at which a plan counts as optimal (default 1e-6)")
    p.add_argument("--threads", type=_positive(int), default=1, metavar="N",
                   help="HiGHS threads (default 1)")
    p.add_argument("--warm-start", metavar="JSON",
                   help="a previous plan.json whose choices seed the search")
    args = p.parse_args(argv)
    if args.mip_gap < 0:
        fail(f"argument --mip-gap: must be >= 0, got {args.mip_gap}")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        problem = Problem.load(args.problem)
    except ValueError as err:
        fail(str(err))
    config = SolverConfig(args.time_limit, args.mip_gap, args.threads)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        solution = solve(problem, args.budget, args.stage_balance, config,
                         _warm_start(args.warm_start))
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    plan = {**solution.to_dict(), "problem": os.path.abspath(args.problem),
            "problem_meta": problem.meta}
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
