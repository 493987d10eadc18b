"""Reference runs that a refactor must reproduce bit for bit (losses, grad norms, plans).

``python tests/e2e/reference_runs.py`` re-records ``reference_runs.json`` (only do that when a
change is *meant* to alter training); ``test_reference_runs.py`` re-runs the same commands and
compares. Three runs: SNIP with two refreshes, ``uniform:fp8``, and the ``min-rel-err``
baseline (statistics-driven, same ILP).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pretrain_runner import FAST_ARGS, launch, read_metrics  # noqa: E402

REFERENCE = Path(__file__).with_name("reference_runs.json")
_SNIP = ["--snip-start", "2", "--snip-interval", "3", "--snip-apply-lag", "1",
         "--snip-budget", "0.5"]
RUNS = {
    "snip": ["--train-iters", "8", "--precision", "snip", *_SNIP],
    "uniform_fp8": ["--train-iters", "6", "--precision", "uniform:fp8"],
    "min_rel_err": ["--train-iters", "6", "--precision", "min-rel-err", *_SNIP],
}
"""name -> pretrain flags (on top of the tests' FAST_ARGS)."""


def machine() -> str:
    """What float results depend on: torch build and the CPU kernels' instruction set."""
    return f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"


def _plan_sites(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)["sites"]


def record_run(flags: list[str], run_dir: Path) -> dict:
    """Run ``flags`` in ``run_dir``; its per-step losses, grad norms and FP4 fractions, and
    the sites of every plan it wrote (each SNIP refresh's and the one in force at the end)."""
    launch([*FAST_ARGS, "--run-dir", str(run_dir), *flags])
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    plans = {os.path.relpath(p, run_dir): _plan_sites(p)
             for p in sorted(glob.glob(str(run_dir / "snip" / "step_*" / "plan.json")))}
    plans["precision_plan.json"] = _plan_sites(str(run_dir / "precision_plan.json"))
    return {"loss": [r["loss"] for r in steps], "grad_norm": [r["grad_norm"] for r in steps],
            "fp4_flop_frac": [r["fp4_flop_frac"] for r in steps], "plans": plans}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: record_run(flags, Path(tmp) / name) for name, flags in RUNS.items()}
    REFERENCE.write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1) + "\n")
    print(f"wrote {REFERENCE}")


if __name__ == "__main__":
    main()
