"""Tokens/s and step time of the tiny model at several TP/PP layouts on this machine.

    python benchmarks/train_throughput.py                 # TP=1 and TP=2/PP=2, 40 steps each
    python benchmarks/train_throughput.py --steps 80 --layouts 1x1 2x1 1x2 2x2

Each layout is a real run of pretrain_llama.py (torchrun on gloo when it needs several
processes); the first --warmup steps are dropped and the median of the rest is reported.
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


def parse_layout(text: str) -> tuple[int, int]:
    try:
        tp, pp = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout '{text}' is not TPxPP, e.g. 2x2") from None
    return tp, pp


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
    records = [json.loads(l) for l in open(run_dir / "metrics.jsonl") if '"loss"' in l]
    timed = [r for r in records if r["step"] > args.warmup]
    step_time = statistics.median(r["step_time_s"] for r in timed)
    return {"tp": tp, "pp": pp, "processes": nproc, "step_time_ms": 1e3 * step_time,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", type=parse_layout, default=[(1, 1), (2, 2)],
                        help="TPxPP layouts to run")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from timing")
    parser.add_argument("--mock-data", action=argparse.BooleanOptionalAction, default=True,
                        help="synthetic tokens (default) or the embedded corpus")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("extra", nargs="*", help="flags passed to pretrain_llama.py after --")
    args = parser.parse_args()
    if args.warmup >= args.steps:
        sys.exit("error: --warmup must be smaller than --steps")
    results = []
    with tempfile.TemporaryDirectory() as work:
        for tp, pp in args.layouts:
            print(f"running TP={tp} PP={pp} ({args.steps} steps) ...", file=sys.stderr, flush=True)
            results.append(run_layout(tp, pp, args, Path(work)))
    print(f"{'layout':<10}{'procs':>6}{'step ms':>10}{'tokens/s':>12}")
    for r in results:
        print(f"{'TP%d PP%d' % (r['tp'], r['pp']):<10}{r['processes']:>6}"
              f"{r['step_time_ms']:>10.1f}{r['tokens_per_s']:>12,.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
