#!/usr/bin/env python
"""Precision budget tuner: plans, a Pareto table and per-stage estimates from SNIP statistics.

Reads a refresh's saved statistics (RUN/snip/step_*/stats.json and RUN/args.json), re-runs
SNIP's steps 4-5 (quality table, ILP) for several FP4 budgets and/or per-stage budgets and
pipeline layouts, and writes one PrecisionPlan per budget (usable with --precision-plan),
report.json and, with --explain, why every site got its formats.

Examples:
    python tools/tune_precision.py --stats runs/x --out tune/
    python tools/tune_precision.py --stats runs/x --budgets 0.5,0.75 --stage-balance time \\
        --pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 4 --out tune/
    python tools/tune_precision.py --stats runs/x --stage-budgets 0.8,0.8,0.6,0.5 \\
        --pipeline-model-parallel-size 4 --explain stages --explain-json why.json --out tune/

Exit status 0 when the plans were written (fallback plans included: see their status), 2 on
bad input: one "error: ..." line on stderr and no file written. The knee, the estimates and
every output are described in docs/tune_precision.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.methods.snip import cli_args  # noqa: E402
from megatron_ext.errors import OneLineParser, UsageError, run_cli  # noqa: E402
from megatron_ext.io import check_output  # noqa: E402

DEFAULT_BUDGETS = (0.25, 0.5, 0.75, 0.8, 0.9)
"""--budgets when neither it nor --stage-budgets is given."""
STAGES_LABEL = "stages"
"""Label (and --explain value) of the per-stage-budget plan."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="tune_precision.py", description=__doc__.split("\n\n")[0],
                epilog="Flags, outputs, definitions and an example: docs/tune_precision.md")
    p.add_argument("--stats", required=True, metavar="PATH",
                   help="a refresh's stats.json, or a run directory (its latest "
                        "snip/step_*/stats.json)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory for plan_b<budget>.json, plan_stages.json and report.json "
                        "(created; files written atomically)")
    p.add_argument("--budgets", type=cli_args.fractions, metavar="E1,E2,...",
                   help="FP4 budgets to sweep (fractions of linear FLOPs; default "
                        f"{','.join(f'{b:g}' for b in DEFAULT_BUDGETS)} unless "
                        "--stage-budgets is given)")
    p.add_argument("--stage-budgets", type=cli_args.fractions, metavar="B0,B1,...",
                   help="one budget per pipeline stage, each a fraction of that stage's "
                        "linear FLOPs; every stage solved on its own")
    p.add_argument("--num-microbatches", type=cli_args.positive(int), metavar="M",
                   help="micro-batches per step for the 1F1B bubble estimate (default: "
                        "global batch / (micro batch x DP) of the run)")
    p.add_argument("--explain", nargs="?", const="knee", metavar="PLAN",
                   help="print per site why it got its formats, for the plan PLAN: a budget "
                        "of --budgets, 'stages', or 'knee' (default: the knee, else the "
                        "largest budget; 'stages' when only --stage-budgets)")
    p.add_argument("--explain-json", metavar="PATH",
                   help="also write the explanation as JSON (implies --explain's analysis)")
    p.add_argument("--device-profile", metavar="NAME|FILE",
                   help="device the estimated times and time-mode plans are for: a built-in "
                        "(auto, nominal, cpu, h100, h200, b200) or a device profile JSON "
                        "(default: the run's --device-profile from its args.json, else auto). "
                        "On h100 / h200 FP4, INT8 and the MX formats are emulated "
                        "(quantize + BF16 GEMM); b200 runs FP8, MXFP8, MXFP4 and NVFP4 "
                        "natively (docs/cost_model.md)")
    cli_args.add_solver_arguments(p)
    cli_args.add_stats_arguments(p)
    return p


# ---------------------------------------------------------------- flags


def _check_flags(args: argparse.Namespace) -> None:
    """Everything that can be checked before reading any file."""
    if args.budgets is None and args.stage_budgets is None:
        args.budgets = list(DEFAULT_BUDGETS)
    budgets = args.budgets or []
    if len(set(budgets)) != len(budgets):
        raise UsageError(f"--budgets lists a budget twice: {budgets}")
    args.budgets = sorted(budgets)
    check_output(args.out, "--out")
    if args.explain_json:
        check_output(args.explain_json, "--explain-json", kind="file")
    args.print_explain = args.explain is not None
    if args.explain_json and args.explain is None:
        args.explain = "knee"
    _check_explain(args)


def _check_explain(args: argparse.Namespace) -> None:
    target = args.explain
    if target in (None, "knee"):
        return
    if target == STAGES_LABEL:
        if args.stage_budgets is None:
            raise UsageError("--explain stages needs --stage-budgets")
        return
    try:
        value = float(target)
    except ValueError:
        raise UsageError(f"--explain: expected a budget, 'knee' or 'stages', got "
                         f"{target!r}") from None
    if not any(math.isclose(value, b) for b in args.budgets):
        raise UsageError(f"--explain {target}: not one of --budgets "
                         f"{','.join(f'{b:g}' for b in args.budgets)}")


# ---------------------------------------------------------------- solving


def _plans(args, planning, config, mode) -> tuple[list[tuple[str, object]], dict | None]:
    """[(label, Solution)] for the sweep and the per-stage budgets, and the Pareto table."""
    from megatron_ext.methods.snip import tune
    from megatron_ext.methods.snip.ilp import solve

    plans, table = [], None
    if args.stage_budgets is not None:
        plans.append((STAGES_LABEL, tune.solve_per_stage(planning.problem,
                                                         args.stage_budgets, config)))
    if args.budgets:
        anchor = solve(planning.problem, 0.0, mode, config)
        sweep = tune.sweep(planning.problem, args.budgets, mode, config)
        table = tune.pareto(planning.problem, anchor, sweep)
        plans = [(_label(s.budget), s) for s in sweep] + plans
    return plans, table


def _label(budget: float) -> str:
    return f"b{budget:g}"


def _explained(args, plans, table) -> str | None:
    """Label of the plan --explain asks for."""
    if args.explain is None:
        return None
    if args.explain == STAGES_LABEL or not args.budgets:
        return STAGES_LABEL
    if args.explain != "knee":
        return next(label for label, s in plans if math.isclose(s.budget, float(args.explain))
                    and label != STAGES_LABEL)
    knee = table["knee"]
    return _label(knee if knee is not None else args.budgets[-1])


# ---------------------------------------------------------------- text


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def _flops(value: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}FLOP"
    return f"{value:.3g} FLOP"


def _layers(layers: list[int]) -> str:
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"L{layers[0]}-L{layers[-1]}" if len(layers) > 1 else f"L{layers[0]}"
    return ",".join(f"L{i}" for i in layers)


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def _print_source(planning, mode: str) -> None:
    r, shape = planning.refresh, planning.shape
    counts = [planning.layer_stage.count(k) for k in range(shape.pipeline_stages)]
    print(f"statistics: step {r.step} of {r.stats_path}; policy {planning.policy}; "
          f"{shape.num_layers} layers on {shape.pipeline_stages} stage(s) "
          f"({'/'.join(map(str, counts))} layers); {len(planning.problem.sites)} sites x "
          f"{len(planning.options)} options; stage balance {mode}; device profile "
          f"{planning.problem.meta['device_profile']}")


def _print_pareto(table: dict, files: dict[str, str]) -> None:
    print("\nPareto: Q = estimated quality loss (ILP objective), saving = estimated step time "
          "vs all-FP8, marginal = dQ / dFP4 fraction from the previous row")
    a = table["anchor"]
    rows = [["0 (anchor)", a["status"], f"{a['fp4_fraction']:.4f}", f"{a['objective']:.6g}",
             f"{100 * a['saving']:.1f}%", "", "", ""]]
    for p in table["points"]:
        marginal = "" if p["marginal"] is None else f"{p['marginal']:.4g}"
        rows.append([f"{p['budget']:g}", p["status"], f"{p['fp4_fraction']:.4f}",
                     f"{p['objective']:.6g}", f"{100 * p['saving']:.1f}%", marginal,
                     files[_label(p["budget"])], "<- knee" if p["knee"] else ""])
    _print_table(["budget", "status", "FP4 frac", "Q", "saving", "marginal", "plan", ""], rows)
    average = table["average_marginal"]
    knee = "none" if table["knee"] is None else f"{table['knee']:g}"
    print(f"knee: {knee} ({table['knee_rule']}; average "
          f"{'n/a' if average is None else f'{average:.4g}'})")


def _print_stages(plans, stages: dict[str, dict]) -> None:
    first = next(iter(stages.values()))
    print(f"\nPipeline: 1F1B, m={first['num_microbatches']} micro-batches, "
          f"p={first['pipeline_stages']} stages, v={first['virtual_stages']}: step ~ "
          "(v*m + p - 1) * slowest stage per micro-batch / v, bubble "
          f"(p - 1)/(v*m + p - 1) = {100 * first['bubble_fraction']:.1f}% of it")
    _print_table(["plan", "FP4 frac", "Q", "saving", "step", "bubble", "bottleneck"],
                 [[label, f"{s.fp4_fraction:.4f}", f"{s.objective:.6g}",
                   f"{100 * stages[label]['saving']:.1f}%", _seconds(stages[label]["step_time"]),
                   _seconds(stages[label]["bubble_time"]), f"stage {stages[label]['bottleneck']}"]
                  for label, s in plans])
    print("\nPer stage: time = estimated GEMM + fixed time of the step's tokens; idle = "
          "share of the step the stage waits")
    rows = [[label, str(s["stage"]), _layers(s["layers"]), _flops(s["linear_flops"]),
             f"{100 * s['flop_share']:.1f}%", f"{s['fp4_fraction']:.3f}", _seconds(s["time"]),
             _seconds(s["fixed_time"]), _seconds(s["time_per_microbatch"]),
             f"{100 * s['idle_fraction']:.1f}%", "<- bottleneck" if s["bottleneck"] else ""]
            for label, st in stages.items() for s in st["stages"]]
    _print_table(["plan", "stage", "layers", "linear FLOPs", "share", "FP4 frac", "time",
                  "fixed", "per micro-batch", "idle", ""], rows)


def _g(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _print_explain(label: str, policy: str, sites: list[dict]) -> None:
    print(f"\nExplain, plan {label} (policy {policy}; formats as x/w/dy classes; next = the "
          "least-Q option with other FP4 FLOPs; dFP4 = change of the model's FP4 fraction)")
    rows = []
    for s in sites:
        n = s["next"] or {}
        rows.append([s["site"], str(s["stage"]), f"{100 * s['flop_share']:.1f}%", s["short"],
                     f"{100 * s['fp4_share']:.0f}%", _g(s["dL"]), _g(s["dW"]), _g(s["q"]),
                     n.get("short", "-"), _g(n.get("q")),
                     "-" if not n else f"{n['dq']:+.3g}",
                     "-" if not n else f"{100 * n['d_fp4_fraction']:+.2f}%"])
    _print_table(["site", "stage", "FLOPs", "chosen", "FP4", "dL", "dW", "Q", "next",
                  "Q next", "dQ", "dFP4"], rows)


# ---------------------------------------------------------------- run


def _report(planning, mode, config, microbatches, plans, files, table, stages, explained,
            explanation) -> dict:
    r = planning.refresh
    return {
        "version": 1,
        "source": {"stats": os.path.abspath(r.stats_path), "args": os.path.abspath(r.args_path),
                   "step": r.step, "policy": planning.policy,
                   "weights": list(planning.weights)},
        "layout": {"pipeline_stages": planning.shape.pipeline_stages,
                   "layer_stage": planning.layer_stage, "num_microbatches": microbatches},
        "stage_balance": mode,
        "solver": {"time_limit": config.time_limit, "mip_gap": config.mip_gap,
                   "threads": config.threads},
        "pareto": table,
        "plans": [{"label": label, "file": files[label], "solution": s.to_dict(),
                   "stage_table": stages[label]} for label, s in plans],
        "explain": None if explained is None else {"plan": explained, "sites": explanation},
    }


def _write(out: str, planning, plans, files, report, explain_json, explanation) -> None:
    from megatron_ext.methods.snip import planner
    from megatron_ext.io import write_json_atomic

    try:
        os.makedirs(out, exist_ok=True)
        for label, solution in plans:
            plan = planner.plan_from_solution(solution, planning.options, planning.policy,
                                              planning.refresh.step)
            write_json_atomic(os.path.join(out, files[label]), plan.to_dict())
        write_json_atomic(os.path.join(out, "report.json"), report)
        if explain_json:
            write_json_atomic(explain_json, report["explain"])
    except OSError as err:
        raise UsageError(f"cannot write {err.filename or out}: {err.strerror}") from None


def _run(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    _check_flags(args)
    from megatron_ext.methods.snip import offline, tune

    from megatron_ext.precision.device_profile import resolve

    named = resolve(args.device_profile) if args.device_profile else None  # bad: exit 2 now
    refresh = offline.load_refresh(args.stats, args.args)
    profile = named or resolve(refresh.run_args.get("device_profile"))
    planning = offline.plan_problem(refresh, args.policy, cli_args.layout_of(args), profile)
    config = cli_args.solver_config(args, refresh.run_args)
    mode = cli_args.stage_balance_of(args, refresh.run_args)
    microbatches = args.num_microbatches or tune.default_microbatches(planning.args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        plans, table = _plans(args, planning, config, mode)
    files = {label: f"plan_{label}.json" for label, _ in plans}
    stages = {label: tune.stage_table(planning, s, microbatches) for label, s in plans}
    explained = _explained(args, plans, table)
    explanation = (None if explained is None else
                   tune.explain(planning, dict(plans)[explained]))
    report = _report(planning, mode, config, microbatches, plans, files, table, stages,
                     explained, explanation)
    _write(args.out, planning, plans, files, report, args.explain_json, explanation)
    _print_source(planning, mode if args.budgets else "per-stage budgets")
    if table is not None:
        _print_pareto(table, files)
    _print_stages(plans, stages)
    if args.print_explain:
        _print_explain(explained, planning.policy, explanation)
    for message in sorted({str(w.message) for w in caught}):
        print(f"warning: {message}", file=sys.stderr)
    print(f"\nwrote {len(plans)} plan(s) and report.json to {args.out}")


def main(argv: list[str] | None = None) -> int:
    """Tune; bad input -> one ``error:`` line on stderr and exit status 2."""
    return run_cli(_run, argv)


if __name__ == "__main__":
    sys.exit(main())
