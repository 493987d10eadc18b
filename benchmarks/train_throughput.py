"""Tokens/s and step time of the tiny model at several TP/PP layouts on this machine.

    python benchmarks/train_throughput.py                 # TP=1 and TP=2/PP=2, 40 steps each
    python benchmarks/train_throughput.py --steps 80 --layouts 1x1 2x1 1x2 2x2

Each layout is a real run of pretrain_llama.py (torchrun on gloo when it needs several
processes); the first --warmup steps are dropped and the median of the rest is reported with
its spread (the 25th-75th percentile of the step times, and their min-max), the number of timed
steps and the machine's load average. Fewer than MIN_TIMED timed steps draws a warning: on a
shared machine one step's time can swing tens of times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIN_TIMED = 20
"""Timed steps below which the median is flagged as unreliable."""


def parse_layout(text: str) -> tuple[int, int]:
    try:
        tp, pp = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout '{text}' is not TPxPP, e.g. 2x2") from None
    return tp, pp


def summarize(step_times_s: list[float], tokens_per_s: list[float]) -> dict:
    """Median step time and tokens/s of the timed steps, with the step times' spread (ms)."""
    ms = sorted(1e3 * t for t in step_times_s)
    q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else ms * 3
    return {"timed_steps": len(ms), "step_time_ms": statistics.median(ms),
            "step_time_p25_ms": q1, "step_time_p75_ms": q3, "step_time_min_ms": ms[0],
            "step_time_max_ms": ms[-1], "tokens_per_s": statistics.median(tokens_per_s)}


def few_steps_warning(steps: int, warmup: int) -> str | None:
    """The warning for a run that times fewer than MIN_TIMED steps (None if enough)."""
    timed = steps - warmup
    if timed >= MIN_TIMED:
        return None
    return (f"warning: only {timed} timed step{'s' if timed != 1 else ''} (--steps {steps} "
            f"minus --warmup {warmup}); a median of so few is unreliable on a shared machine: "
            f"use --steps {warmup + MIN_TIMED} or more")


def run_layout(tp: int, pp: int, args: argparse.Namespace, work: Path) -> dict:
    run_dir = work / f"tp{tp}_pp{pp}"
    train = ["--train-iters", str(args.steps), "--log-interval", "1", "--eval-iters", "0",
             "--no-save", "--run-dir", str(run_dir), "--tensor-model-parallel-size", str(tp),
             "--pipeline-model-parallel-size", str(pp), *args.extra]
    if args.mock_data:
        train.append("--mock-data")
    nproc = tp * pp
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    proc = subprocess.run([*launcher, str(REPO / "pretrain_llama.py"), *train], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: layout {tp}x{pp} failed:\n{proc.stderr[-2000:]}")
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if '"loss"' in line]
    timed = [r for r in records if r["step"] > args.warmup]
    return {"tp": tp, "pp": pp, "processes": nproc,
            **summarize([r["step_time_s"] for r in timed], [r["tokens_per_s"] for r in timed])}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", type=parse_layout, default=[(1, 1), (2, 2)],
                        help="TPxPP layouts to run")
    parser.add_argument("--steps", type=int, default=40, help="training steps per layout")
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from timing")
    parser.add_argument("--mock-data", action=argparse.BooleanOptionalAction, default=True,
                        help="synthetic tokens (default) or the embedded corpus")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("extra", nargs="*", help="flags passed to pretrain_llama.py after --")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be >= 0 and smaller than --steps")  # exit status 2
    return args


def print_table(results: list[dict]) -> None:
    print(f"{'layout':<10}{'procs':>6}{'timed':>7}{'step ms':>10}{'p25-p75 ms':>16}"
          f"{'min-max ms':>16}{'tokens/s':>11}")
    for r in results:
        print(f"{'TP%d PP%d' % (r['tp'], r['pp']):<10}{r['processes']:>6}{r['timed_steps']:>7}"
              f"{r['step_time_ms']:>10.1f}"
              f"{'%.0f-%.0f' % (r['step_time_p25_ms'], r['step_time_p75_ms']):>16}"
              f"{'%.0f-%.0f' % (r['step_time_min_ms'], r['step_time_max_ms']):>16}"
              f"{r['tokens_per_s']:>11,.0f}")
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} cores when done"
          + (" (busy: compare layouts on an idle machine)" if load > os.cpu_count() else ""))


def main() -> None:
    args = parse_args()
    warning = few_steps_warning(args.steps, args.warmup)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    results = []
    with tempfile.TemporaryDirectory() as work:
        for tp, pp in args.layouts:
            print(f"running TP={tp} PP={pp} ({args.steps} steps) ...", file=sys.stderr, flush=True)
            results.append(run_layout(tp, pp, args, Path(work)))
    print_table(results)
    if warning:
        print(warning)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
