"""SNIP's estimator against ground truth (paper Fig. 13) on the tiny Llama (not a test).

    python benchmarks/snip_estimator.py                 # train 200 steps, then check
    python benchmarks/snip_estimator.py --train-iters 50 --out est.png
    python benchmarks/snip_estimator.py --run-dir runs/est   # keep (or reuse) the trained run
    python benchmarks/snip_estimator.py --run-dir runs/est --probe dgrad   # dgrad-shaped probe

Trains the ``tiny`` Llama on the embedded corpus (``pretrain_llama.py`` in a child process,
saving a checkpoint), loads it here in one process and runs
:func:`megatron_ext.methods.snip.groundtruth.check` on the first validation batch: per site, SNIP's
estimated ΔL / ΔW of FP4 against the measured loss change / one-step weight divergence.
Prints the table and the Spearman rank correlations; ``--out`` plots estimated vs measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _train(run_dir: Path, iters: int, extra: list[str]) -> None:
    cmd = [sys.executable, str(REPO / "pretrain_llama.py"), "--train-iters", str(iters),
           "--eval-iters", "0", "--run-dir", str(run_dir), "--precision", "uniform:bf16",
           *extra]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)


def load_run(load: Path, out_dir: Path, extra: list[str]):
    """(args, run) of the tiny Llama loaded from ``load`` (a save root or one iteration
    directory) in this process, its precision plan overridable, nothing saved."""
    from megatron_ext.defaults import default_extensions
    from megatron_ext.training.arguments import parse_args
    from megatron_ext import extension as ext
    from megatron_ext.training.pretrain import setup

    exts = default_extensions()
    args = parse_args("llama", ["--load", str(load), "--no-save",
                                "--use-checkpoint-opt_param-scheduler",
                                "--precision", "uniform:bf16", "--override-precision-plan",
                                "--run-dir", str(out_dir), *extra],
                      ext.args_provider(exts))
    for e in exts:
        if e.validate:
            e.validate(args)
    return args, setup(args, exts)


def run_check(run_dir: Path, extra: list[str], noise: float, loss_batches: int = 1,
              fp4: str = "fp4", probe: str = "isotropic"):
    from megatron_ext.methods.snip.groundtruth import check
    from megatron_ext.methods.snip.candidates import parse_candidates
    from megatron_ext.precision.policies import UNIFORM

    args, run = load_run(run_dir / "checkpoints", run_dir / "check", extra)
    cands = parse_candidates(f"fp8,{fp4}").all_formats()
    return check(args, run, run.datasets[1], UNIFORM[fp4], UNIFORM["bf16"].__class__(),
                 cands, noise, loss_batches, probe)


def _plot(result, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, est, true, name, rho in (
            (axes[0], result.est_dL, result.true_dL, "ΔL", result.spearman_dL),
            (axes[1], result.est_dW_wgrad, result.true_dW_wgrad, "ΔW (wgrad)",
             result.spearman_dW_wgrad),
            (axes[2], result.est_dW, result.true_dW, "ΔW (backward)", result.spearman_dW)):
        ax.loglog(est, true, "o")
        for sid, e, t in zip(result.sites, est, true):
            ax.annotate(sid, (e, t), fontsize=6)
        ax.set_xlabel(f"SNIP estimate {name}")
        ax.set_ylabel(f"measured {name}")
        ax.set_title(f"{name}: Spearman {rho:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _ratio_range(est, true) -> str:
    ratios = [e / t for e, t in zip(est, true) if t > 0]
    return f"est/measured {min(ratios):.2f}-{max(ratios):.2f}"


def _report(result) -> None:
    heads = ("est dL", "true dL", "est dW", "true dW", "est dWw", "true dWw", "paper dWw")
    print(f"{'site':10} " + " ".join(f"{h:>10}" for h in heads))
    for row in zip(result.sites, result.est_dL, result.true_dL, result.est_dW, result.true_dW,
                   result.est_dW_wgrad, result.true_dW_wgrad, result.est_dW_wgrad_paper):
        print(f"{row[0]:10} " + " ".join(f"{v:10.3e}" for v in row[1:]))
    print(f"Spearman dL {result.spearman_dL:.3f} ({_ratio_range(result.est_dL, result.true_dL)})")
    print(f"Spearman dW backward {result.spearman_dW:.3f} "
          f"({_ratio_range(result.est_dW, result.true_dW)})")
    print(f"Spearman dW wgrad {result.spearman_dW_wgrad:.3f} "
          f"({_ratio_range(result.est_dW_wgrad, result.true_dW_wgrad)})")
    print(f"Spearman dW wgrad, paper's isotropic formula {result.spearman_dW_wgrad_paper:.3f} "
          f"({_ratio_range(result.est_dW_wgrad_paper, result.true_dW_wgrad)})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--noise", type=float, default=1e-2, help="--snip-noise of the probes")
    p.add_argument("--out", default=None, help="PNG of estimated vs measured")
    p.add_argument("--model-args", default="", help="extra pretrain flags, one string")
    p.add_argument("--loss-batches", type=int, default=1, metavar="K",
                   help="ΔL (estimated and measured) as the RMS over the first K held-out "
                        "batches (default 1: one draw of the loss change per site)")
    p.add_argument("--fp4", default="fp4", choices=("fp4", "fp4-tensor"),
                   help="the low format whose effect is estimated and measured: the tile-scaled "
                        "FP4 recipe, or E2M1 with one scale per tensor, round to nearest (the "
                        "comparison regime's, docs/compare.md)")
    p.add_argument("--probe", default="isotropic", choices=("isotropic", "dgrad"),
                   help="--snip-probe of the estimate: isotropic backward-probe noise, or "
                        "shaped like a dgrad error (docs/snip.md)")
    p.add_argument("--json", default=None, help="write every number of the check here")
    p.add_argument("--run-dir", default=None,
                   help="train into this directory and keep it; when it already holds "
                        "checkpoints, skip training and check those")
    opts = p.parse_args(argv)
    extra = opts.model_args.split()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(opts.run_dir or Path(tmp) / "run")
        if not (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").exists():
            _train(run_dir, opts.train_iters, extra)
        result = run_check(run_dir, extra, opts.noise, opts.loss_batches, opts.fp4,
                           opts.probe)
    _report(result)
    if opts.json:
        Path(opts.json).write_text(json.dumps(dataclasses.asdict(result), indent=1))
    if opts.out:
        _plot(result, opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
