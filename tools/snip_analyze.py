#!/usr/bin/env python
"""Solve SNIP's precision-selection ILP for a saved problem or refresh and write the plan.

Reads a problem.json (sites, options with quality loss / FP4 FLOPs / FLOPs / time, pipeline
stages; the in-training planner writes one per refresh) — or, with --stats, re-runs steps 4-5
of a refresh from its saved statistics (stats.json and the run's args.json), for another
budget, policy or pipeline layout — solves the ILP of SNIP §5 with HiGHS and writes two files:

* ``--out plan.json``: the PrecisionPlan (site -> formats) that ``pretrain_*.py
  --precision-plan`` and ``tools/plot_precision.py plan`` read;
* beside it ``plan.solution.json`` (or ``--solution PATH``): the ILP solution — the chosen
  option per site, the objective, the FP4 fraction overall and per stage, per-stage time,
  solver status, MIP gap and solve time.

A problem whose options are plain names (``fp8``, ``fp4:x+w``: hand-written or synthetic)
has no formats to run, so it takes ``--solution`` alone. Schemas and the math: docs/snip.md.

Examples:
    python tools/snip_analyze.py --problem runs/x/snip/step_000100/problem.json \
        --budget 0.75 --out plan.json
    python tools/snip_analyze.py --problem problem.json --budget 0.5 --stage-balance time \
        --time-limit 5 --warm-start previous_plan.json --out plan.json
    python tools/snip_analyze.py --stats runs/x --budget 0.75 \
        --pipeline-model-parallel-size 4 --out plan.json
    python tools/snip_analyze.py --problem synthetic.json --budget 0.5 --solution sol.json

Exit status: 0 when a plan was written (also the safe fallback plan: see the solution's
"status"), 2 on bad input (one "error: ..." line on stderr).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.methods.snip import cli_args  # noqa: E402
from megatron_ext.methods.snip.ilp import solve  # noqa: E402
from megatron_ext.errors import UsageError, run_cli  # noqa: E402
from megatron_ext.io import check_output, read_json, write_json_atomic, write_text_atomic  # noqa: E402,E501
from megatron_ext.methods.snip.problem import Problem  # noqa: E402

_FORMATS_NAME = re.compile(r"x=[^,=]+,w=[^,=]+,dy=[^,=]+")
"""An option name that lists its formats (what the in-training planner writes)."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one ``error:`` line (raised, so ``main`` returns 2)."""

    def error(self, message):
        raise UsageError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
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
    p.add_argument("--out", metavar="JSON",
                   help="the PrecisionPlan to write (what --precision-plan reads); atomic")
    p.add_argument("--solution", metavar="JSON",
                   help="where the ILP solution goes (default: beside --out, "
                        "<out>.solution.json)")
    p.add_argument("--warm-start", metavar="JSON",
                   help="a previous plan (or solution) whose choices seed the search")
    cli_args.add_solver_arguments(p)
    cli_args.add_stats_arguments(p)
    args = p.parse_args(argv)
    if args.problem and (args.args or args.policy or cli_args.layout_given(args)):
        raise UsageError("--args, --policy and the layout flags need --stats")
    if not (args.out or args.solution):
        raise UsageError("give --out (the plan; the solution goes beside it) and/or "
                         "--solution")
    args.solution = args.solution or solution_path(args.out)
    if args.out and os.path.abspath(args.out) == os.path.abspath(args.solution):
        raise UsageError("--out and --solution name the same file")
    if args.out:
        check_output(args.out, "--out", kind="file")
    check_output(args.solution, "--solution", kind="file")
    return args


def solution_path(out: str) -> str:
    """Where the solution goes beside the plan ``out``: ``plan.json`` -> ``plan.solution.json``."""
    root, ext = os.path.splitext(out)
    return f"{root}.solution{ext or '.json'}"


def _warm_start(path: str | None) -> dict[str, str] | None:
    """site -> option name of a previous solution, or of a previous plan."""
    if path is None:
        return None
    try:
        data = read_json(path)
    except ValueError as err:
        raise UsageError(f"--warm-start: {err}") from None
    if isinstance(data.get("choice"), dict):
        return data["choice"]
    from megatron_ext.methods.snip.candidates import option_name
    from megatron_ext.precision.plan import load_plan

    try:
        return {sid: option_name(f) for sid, f in load_plan(path).sites.items()}
    except ValueError as err:
        raise UsageError(f"--warm-start: neither a solution (no 'choice') nor a plan: "
                         f"{err}") from None


def _check_plan_possible(problem: Problem, args: argparse.Namespace) -> None:
    """A plan needs every option to name its formats (``x=<fmt>,w=<fmt>,dy=<fmt>``)."""
    if not args.out:
        return
    for site in problem.sites:
        for option in site.options:
            if not _FORMATS_NAME.fullmatch(option.name):
                raise UsageError(
                    f"--out: option '{option.name}' of {site.site} is a name, not formats "
                    "(x=<fmt>,w=<fmt>,dy=<fmt>), so there is no plan to run; write the "
                    "solution alone with --solution")


def _plan(problem: Problem, solution):
    """The PrecisionPlan of ``solution`` (method and step from the problem's meta)."""
    from megatron_ext.methods.snip.candidates import parse_option_name
    from megatron_ext.methods.snip.planner import plan_from_solution

    names = dict.fromkeys(o.name for s in problem.sites for o in s.options)
    return plan_from_solution(solution, [parse_option_name(n) for n in names],
                              str(problem.meta.get("policy", "snip")),
                              int(problem.meta.get("step", 0)))


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


def _run(argv: list[str]) -> None:
    args = parse_args(argv)
    problem, run_args, source = load_problem(args)
    _check_plan_possible(problem, args)
    config = cli_args.solver_config(args, run_args)
    mode = cli_args.stage_balance_of(args, run_args)
    warm = _warm_start(args.warm_start)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        solution = solve(problem, args.budget, mode, config, warm)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    plan = _plan(problem, solution) if args.out else None
    write_json_atomic(args.solution, {**solution.to_dict(), **source,
                                      "problem_meta": problem.meta})
    written = args.solution
    if plan is not None:
        write_text_atomic(args.out, plan.to_json() + "\n")
        written = f"{args.out} (solution: {args.solution})"
    stages = ", ".join(f"{f:.3f}" for f in solution.stage_fp4_fraction)
    print(f"{solution.status}: objective {solution.objective:.6g}, FP4 fraction "
          f"{solution.fp4_fraction:.4f} (stages {stages}), {solution.solve_time:.3f} s "
          f"-> {written}")


def main(argv: list[str] | None = None) -> int:
    """Solve and write; bad input -> one ``error:`` line on stderr and exit status 2."""
    return run_cli(_run, argv)


if __name__ == "__main__":
    sys.exit(main())
