"""Peak memory of a SNIP refresh against a normal step of the same run (not a test).

    python benchmarks/snip_memory.py runs/snip_memory --train [-- extra training flags]
    python benchmarks/snip_memory.py runs/snip_memory/snip     # analyse a finished run

A refresh at step ``s`` copies the weights before step ``s+1`` and runs its three observed
passes after that step, so its memory shows in the ``mem_gib`` of step ``s+1``'s record
(``metrics.jsonl`` with ``--log-interval 1``: the peak since the previous record; CPU: peak
RSS, GPU: ``torch.cuda.max_memory_allocated``). :func:`refresh_vs_step` compares that with the
largest ``mem_gib`` of the steps before the first refresh (the steps after it keep what the
allocator holds on CPU). Target (issue 22): refresh <= 1.15x. ``--train`` makes a run with
:data:`TRAIN_FLAGS` (plus whatever follows ``--``: on a GPU, the TinyLlama-1.1B shape) through
``benchmarks/precision_quality.py``; for ``benchmarks/gpu_check.py`` call
:func:`refresh_vs_step` on the run directory of any ``--precision snip`` run logged every
step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from precision_quality import read_metrics, train

TRAIN_FLAGS = ["--precision", "snip", "--snip-budget", "0.5", "--snip-start", "3",
               "--snip-interval", "0", "--snip-apply-lag", "1", "--train-iters", "5",
               "--log-interval", "1", "--eval-iters", "0"]
"""One refresh at step 3 (its memory in step 4's record), two normal steps before it."""


def refresh_vs_step(run_dir: Path) -> dict:
    """``{"normal_gib", "refresh_gib", "ratio", "refresh_step"}`` of a run's first refresh;
    ``ValueError`` when the run has no refresh or no ``mem_gib`` before it."""
    steps = [r for r in read_metrics(Path(run_dir)) if "loss" in r]
    refresh = next((r for r in steps if "snip_refresh" in r), None)
    if refresh is None:
        raise ValueError(f"'{run_dir}': no SNIP refresh in metrics.jsonl (--log-interval 1?)")
    before = [r["mem_gib"] for r in steps if r["step"] < refresh["step"] and "mem_gib" in r]
    if not before or "mem_gib" not in refresh:
        raise ValueError(f"'{run_dir}': no mem_gib before or at the refresh")
    normal = max(before)
    return {"normal_gib": normal, "refresh_gib": refresh["mem_gib"],
            "ratio": refresh["mem_gib"] / normal, "refresh_step": refresh["snip_refresh"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the run directory (with --train: its parent)")
    p.add_argument("--train", action="store_true", help="make the run first")
    p.add_argument("flags", nargs="*", help="extra training flags (after --)")
    args = p.parse_args(argv)
    run_dir = args.out
    if args.train:
        train("snip", [*TRAIN_FLAGS, *args.flags], args.out)
        run_dir = args.out / "snip"
    print(json.dumps(refresh_vs_step(run_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
