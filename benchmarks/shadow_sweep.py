"""The GPU shadow over every method and layout, on CPU: what to run before a GPU session.

    python benchmarks/shadow_sweep.py --out /tmp/sweep                 # all, ~6 min
    python benchmarks/shadow_sweep.py --configs snip-tp2 pgq --cuda-branches-only

Each config trains ``benchmarks/host_syncs.py``'s way (``gpu_shadow.py``: every tensor placed
where a GPU run keeps it) at a small shape, under torchrun where it has more than one rank,
once on the code's CPU side and once with ``--cuda-branches`` (its GPU side, the Triton
kernels in Triton's interpreter). A row fails when the run fails or an op would mix host and
device tensors (a crash on a GPU only); it also gives the host reads and blocking uploads of
the median unlogged step and the most of any step. Writes ``<out>/shadow_sweep.json`` and
``.md``; exits 1 if a row failed. Not a test: the suite runs the composed cases
(``tests/e2e/test_host_syncs.py``, ``tests/distributed/test_gpu_shadow_parallel.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_ext.errors import OneLineParser, run_cli  # noqa: E402
from megatron_ext.io import write_text_atomic  # noqa: E402

SHAPE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
         "--num-attention-heads", "2", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--lr-warmup-iters", "1",
         "--train-iters", "4", "--log-interval", "2", "--eval-iters", "0"]
SNIP = ["--precision", "snip", "--snip-start", "2", "--snip-interval", "0",
        "--snip-offload", "host"]
CONFIGS = {
    "uniform:fp8": (1, ["--precision", "uniform:fp8", "--no-save"]),
    "nvfp4": (1, ["--precision", "uniform:nvfp4", "--no-save"]),
    "pgq": (1, ["--precision", "pgq", "--pgq-candidates", "all", "--no-save"]),
    "gnmr-autoswitch": (1, ["--precision", "uniform:fp4", "--gnmr", "--gnmr-rule", "autoswitch",
                            "--no-save"]),
    "composed": (1, [*SNIP, "--gnmr", "--optimizer", "stquant-adamw", "--gaussws", "od",
                     "--no-save"]),
    "save+eval": (1, ["--precision", "uniform:fp8", "--save-interval", "2", "--eval-iters", "1",
                      "--eval-interval", "2"]),
    "snip-tp2+gnmr": (2, [*SNIP, "--tensor-model-parallel-size", "2", "--gnmr", "--no-save"]),
    "snip-pp2+gaussws": (2, [*SNIP, "--pipeline-model-parallel-size", "2", "--gaussws", "od",
                             "--no-save"]),
    "pgq-tp2": (2, ["--precision", "pgq", "--tensor-model-parallel-size", "2", "--no-save"]),
    "stquant-distopt+gnmr": (2, ["--optimizer", "stquant-adamw", "--use-distributed-optimizer",
                                 "--gnmr", "--precision", "uniform:fp4", "--no-save"]),
    "fsdp2": (2, ["--use-torch-fsdp2", "--precision", "uniform:fp4", "--no-save"]),
}
"""Name -> (ranks, flags on top of :data:`SHAPE`)."""


def run(name: str, cuda_branches: bool, out: Path) -> dict:
    """One row: train ``name`` under the shadow; rc, mixed ops, reads and uploads."""
    nproc, flags = CONFIGS[name]
    tag = f"{name}{' gpu' if cuda_branches else ''}".replace(":", "-").replace(" ", "-")
    launch = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd = [*launch, str(REPO / "benchmarks" / "host_syncs.py"),
           *(["--cuda-branches"] if cuda_branches else []), "--json", str(out / f"{tag}.json"),
           "--", *SHAPE, *flags, "--run-dir", str(out / tag)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=900)
    row = {"config": name, "side": "GPU" if cuda_branches else "CPU", "ranks": nproc,
           "rc": proc.returncode,
           "mixed": [line for line in proc.stderr.splitlines() if line.startswith("step ")]}
    if proc.returncode == 0:
        steps = json.loads((out / f"{tag}.json").read_text())
        quiet = [s for s in steps if not s["logged"]] or steps
        row |= {"reads": statistics.median(s["count"] for s in quiet),
                "uploads": statistics.median(s["uploads"] for s in quiet),
                "launches": statistics.median(s["launches"] for s in quiet),
                "most reads": max(s["count"] for s in steps),
                "most uploads": max(s["uploads"] for s in steps)}
    elif not row["mixed"]:
        row["error"] = (proc.stdout[-600:] + proc.stderr[-1200:]).strip()
    return row


def table(rows: list[dict]) -> str:
    lines = ["| config | side | ranks | result | reads / uploads, median unlogged step | most "
             "| launches, median unlogged step |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        result = "ok" if r["rc"] == 0 else (f"**{len(r['mixed'])} mixed**" if r["mixed"]
                                            else f"**failed ({r['rc']})**")
        per_step = f"{r['reads']:g} / {r['uploads']:g}" if "reads" in r else ""
        most = f"{r['most reads']} / {r['most uploads']}" if "reads" in r else ""
        launches = f"{r['launches']:g}" if "reads" in r else ""
        lines.append(f"| {r['config']} | {r['side']} | {r['ranks']} | {result} | {per_step} | "
                     f"{most} | {launches} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("shadow_sweep"),
                   help="folder for the runs and shadow_sweep.json / .md")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                   help="which configs (default: all)")
    side = p.add_mutually_exclusive_group()
    side.add_argument("--cuda-branches-only", action="store_true",
                      help="only the GPU side of the code (Triton in its interpreter)")
    side.add_argument("--cpu-side-only", action="store_true", help="only the CPU side")
    args = p.parse_args(argv)
    sides = [s for s in (False, True)
             if not (s and args.cpu_side_only or not s and args.cuda_branches_only)]
    jobs = [(name, s) for name in args.configs for s in sides]
    args.out.mkdir(parents=True, exist_ok=True)
    rows, start = [], time.monotonic()
    for i, (name, cuda_branches) in enumerate(jobs, 1):
        rows.append(run(name, cuda_branches, args.out))
        spent = time.monotonic() - start
        eta = spent / i * (len(jobs) - i)
        print(f"[{i}/{len(jobs)}] {json.dumps(rows[-1])} | ETA {eta:.0f} s", flush=True)
    write_text_atomic(args.out / "shadow_sweep.json", json.dumps(rows, indent=1) + "\n")
    write_text_atomic(args.out / "shadow_sweep.md", table(rows))
    print(table(rows))
    if any(r["rc"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    sys.exit(run_cli(main))
