"""Quality of uniform low-precision training against FP32 (not a test).

Trains the ``tiny`` Llama on the embedded corpus (the default data) once per precision and
prints the final validation loss of each run and its gap to the FP32 run:

    python benchmarks/precision_quality.py                      # fp32, uniform:fp8, uniform:fp4
    python benchmarks/precision_quality.py --seeds 1234 1235 1236   # and the seed spread
    python benchmarks/precision_quality.py --train-iters 50 --runs fp32 uniform:fp8

Each run is ``pretrain("llama")`` with the precision and SNIP extensions (those of
``pretrain_llama.py``) in a child process (this script re-invoked with ``--pretrain``), with
the same seed and data order; only the linear GEMMs' formats differ. Its output goes to
``<run dir>/train.log``. ``benchmarks/precision_step_time.py`` reuses :func:`train` and
:func:`summarize`. Grids of any runs x seeds with standard errors and paired differences:
``tools/compare_precision.py`` (docs/compare.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(name: str, flags: list[str], out_dir: Path, reuse: bool = False) -> list[dict]:
    """One training run in a child process, in ``out_dir/<name>``; returns its metrics
    records. With ``reuse``, a run that already finished there is read, not run again; any
    other run directory of that name is deleted first (its metrics would be appended to)."""
    run_dir = out_dir / name.replace(":", "-")
    if reuse and finished(run_dir):
        return read_metrics(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--pretrain", "--no-save",
           "--run-dir", str(run_dir), *flags]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with open(run_dir / "train.log", "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              check=False)
    if proc.returncode != 0:
        tail = (run_dir / "train.log").read_text(encoding="utf-8")[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{tail}")
    return read_metrics(run_dir)


def report_main(doc: str, train_flags: list[str], report, argv=None) -> None:
    """The command line of an overhead benchmark (``snip_overhead.py``, ``gnmr_overhead.py``):
    ``RUN_DIR [--train] [--skip N] [--extra FLAGS...]``; prints ``report(run_dir, skip)``,
    after making the run with ``train_flags`` (+ ``--extra``) when ``--train`` is given."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="the run's directory (metrics.jsonl, args.json)")
    p.add_argument("--train", action="store_true",
                   help="first make the run there (replacing an unfinished one)")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="with --train: further pretrain flags (put last)")
    args = p.parse_args(argv)
    run_dir = args.run_dir.resolve()
    if args.train:
        train(run_dir.name, [*train_flags, *args.extra], run_dir.parent, reuse=True)
    print(report(run_dir, args.skip), end="")


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl``."""
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def finished(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a completed run: a validation record at ``--train-iters``."""
    try:
        train_iters = json.loads((run_dir / "args.json").read_text())["train_iters"]
        records = read_metrics(run_dir)
    except (OSError, ValueError, KeyError):
        return False
    return any(r.get("step") == train_iters and "val_loss" in r for r in records)


def precision_flags(run: str) -> list[str]:
    """``fp32`` -> no flag (megatron's own linears); anything else -> ``--precision run``."""
    return [] if run == "fp32" else ["--precision", run]


def summarize(records: list[dict]) -> dict:
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    steps = [r for r in records if "step_time_s" in r]
    return {"val_loss": val[max(val)], "val_curve": val,
            "median_step_s": statistics.median(r["step_time_s"] for r in steps[1:])}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=["fp32", "uniform:fp8", "uniform:fp4"],
                   help="fp32 and/or --precision values")
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234],
                   help="one run per seed and precision; several show the run-to-run spread")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="further pretrain flags for every run (put last)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    common = ["--train-iters", str(args.train_iters), "--log-interval", "10", *args.extra]
    results = {run: {} for run in args.runs}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for run in args.runs:
                flags = [*common, "--seed", str(seed), *precision_flags(run)]
                results[run][seed] = summarize(train(f"{run}-{seed}", flags, Path(tmp)))
                print(f"{run} seed {seed}: {results[run][seed]}", flush=True)
    means = {run: statistics.mean(r["val_loss"] for r in by_seed.values())
             for run, by_seed in results.items()}
    print(f"\ntiny Llama, embedded corpus, {args.train_iters} steps: final validation loss")
    print(f"{'run':<14}" + "".join(f"{'seed ' + str(s):>11}" for s in args.seeds)
          + f"{'mean':>9}{'vs fp32':>10}")
    for run, by_seed in results.items():
        gap = f"{100 * (means[run] / means['fp32'] - 1):+9.2f}%" if "fp32" in means else ""
        print(f"{run:<14}" + "".join(f"{by_seed[s]['val_loss']:11.4f}" for s in args.seeds)
              + f"{means[run]:9.4f}{gap:>10}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pretrain"]:  # child: one run (the guard matters for checkpoints)
        sys.path.insert(0, str(REPO))
        from megatron_ext.defaults import default_extensions
        from megatron_ext.training.pretrain import main as pretrain_main

        sys.argv = [sys.argv[0], *sys.argv[2:]]
        sys.exit(pretrain_main("llama", extensions=default_extensions()))
    main()
