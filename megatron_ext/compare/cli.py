"""Command line of ``tools/compare_precision.py`` (also ``python -m megatron_ext.compare.cli``).

Exit status 0: every job finished and ``OUT/results.json``, ``OUT/results.md`` and the PNGs
were written. 2: bad input, one ``error:`` line on stderr, nothing run or written. 1: a job
failed (the others still ran and are kept for the next invocation); one ``error:`` line
names the failed jobs and their logs; no results file (an earlier invocation's
``results.json``, ``results.md`` and ``img/*.png`` are removed when the jobs start, so a
stale one is never read as this grid's).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from megatron_ext.compare import figures, report
from megatron_ext.compare.grid import build_grid, load_config, resolve_entry
from megatron_ext.compare.jobs import Job, check_scored, is_finished, make_jobs, read_metrics
from megatron_ext.compare.results import collect
from megatron_ext.compare.runner import check_flags, run_jobs
from megatron_ext.errors import OneLineParser, UsageError, run_cli
from megatron_ext.io import write_text_atomic

REPO = Path(__file__).resolve().parents[2]
"""The repository root: where a relative ``--entry`` is looked for second."""
RESULTS = ("results.json", "results.md")
"""The result files in ``OUT`` (``results.json`` is written last)."""


class GridFailed(Exception):
    """Some jobs failed: exit status 1, no results."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="compare_precision.py", description="Train a grid of runs x seeds and "
                "compare their final validation losses (docs/compare.md).")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="jobs in DIR/runs/NAME/seed_S; results.json, results.md, img/*.png")
    p.add_argument("--config", metavar="GRID.yaml",
                   help="YAML or JSON grid: keys entry, base_flags, seeds, reference, "
                        "group_by, random_draws, runs (the flags below replace or extend it)")
    p.add_argument("--run", action="append", default=[], metavar="NAME=FLAGS",
                   help="a run and its pretrain flags (repeat; added to the config's runs); "
                        "write --run NAME=\"--flag v\" or --run \"NAME=--flag v\"")
    p.add_argument("--seeds", metavar="S1,S2,...",
                   help="every run is trained once per seed (replaces the config's)")
    p.add_argument("--reference", metavar="NAME",
                   help="paired differences against this run (replaces the config's)")
    p.add_argument("--group-by", metavar="FLAG",
                   help="rank runs within groups of equal values of this flag, e.g. "
                        "--group-by=--snip-budget (or snip-budget)")
    p.add_argument("--random-draws", type=int, metavar="K",
                   help="every run whose flags contain {draw} (e.g. --pgq-random "
                        "--pgq-random-draw {draw}) becomes K runs NAME.d0 .. NAME.d<K-1>, "
                        "one random draw each per seed (replaces the config's random_draws)")
    p.add_argument("--base-flags", metavar="FLAGS",
                   help="flags of every run, appended to the config's base flags; write "
                        "--base-flags=\"--train-iters 40\"")
    p.add_argument("--entry", metavar="SCRIPT",
                   help="training script (default pretrain_llama.py; replaces the config's)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="training processes at a time, one thread each (default 1)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the jobs and their exact commands (and which are finished); "
                        "run and write nothing")
    p.add_argument("--no-plots", action="store_true", help="results.json and results.md only")
    return p


def _grid(args: argparse.Namespace):
    config = load_config(args.config) if args.config else {}
    cli = {"seeds": args.seeds, "reference": args.reference, "group_by": args.group_by,
           "entry": args.entry, "base_flags": args.base_flags,
           "random_draws": args.random_draws}
    return build_grid(config, cli, args.run)


def dry_run(jobs: list[Job]) -> None:
    """Print every job: ``run`` / ``reuse`` (finished) / ``rerun`` (a broken directory)."""
    print(f"{len(jobs)} jobs:")
    for job in jobs:
        state = "reuse" if is_finished(job) else "rerun" if job.dir.exists() else "run"
        print(f"{state:<5} {job.tag}: {shlex.join(['python', *job.argv])}")


def write_results(grid, jobs: list[Job], out: Path, plots: bool) -> str:
    """Read every job's metrics and write the PNGs, results.md, then results.json."""
    metrics = {(job.run.name, job.seed): read_metrics(job.dir) for job in jobs}
    results = collect(grid, metrics)
    pictures = figures.draw(grid, results, metrics, out) if plots else []
    text = report.markdown(results, pictures)
    write_text_atomic(out / "results.md", text)
    write_text_atomic(out / "results.json", json.dumps(results, indent=1, allow_nan=False)
                      + "\n")
    return text


def _run(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: '{out}' exists and is not a directory")
    grid = _grid(args)
    jobs = make_jobs(grid, resolve_entry(grid.entry, REPO), out)
    check_scored(jobs)
    if args.dry_run:
        dry_run(jobs)
        return
    refused = check_flags([job for job in jobs if not is_finished(job)], args.jobs)
    if refused:  # before any run trains: a typo in one must not cost the others' hours
        more = f" (and {len(refused) - 1} more run(s))" if len(refused) > 1 else ""
        raise UsageError(refused[0] + more)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*(out / name for name in RESULTS), *(out / "img").glob("*.png")]:
        stale.unlink(missing_ok=True)
    failed = run_jobs(jobs, args.jobs)
    if failed:
        raise GridFailed(f"{len(failed)} of {len(jobs)} jobs failed, no results written: "
                         + "; ".join(failed))
    print(write_results(grid, jobs, out, not args.no_plots), end="", flush=True)
    print(f"results: {out / 'results.md'}, {out / 'results.json'}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; the exit status (see the module docstring)."""
    try:
        return run_cli(_run, argv)
    except GridFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
