"""Keep a claim grid's per-seed evidence in the repository (not a test).

    python benchmarks/claims_keep.py runs/stquant_parity benchmarks/results/claims/stquant_parity \
        --config examples/compare/stquant_parity.yaml --metric stquant_state_bytes_per_param

Reads ``GRID/runs/<run>/seed_<s>/`` of ``tools/compare_precision.py`` (finished jobs only:
those that validated at their last step) and writes into ``OUT``:

* ``runs.json``: per run and seed the validation losses (step, loss), the last training loss,
  the last value of each ``--metric`` and, for a PGQ run, its plan (``pgq/recipe.json``:
  summary, quantized fraction, the quantized GEMMs and the recipe's seed);
* ``seeds.csv``: ``seed``, one column per run with its final validation loss and one
  ``<run>:<metric>`` column per metric (what ``benchmarks/claims_table.py`` tests read);
* ``source.json``: the grid's config file as text, the job's command of every run (its first
  seed), and the code commit (``--commit``, else ``git rev-parse HEAD`` with ``dirty`` if the
  work tree was).

No checkpoints, no logs: a few KB per claim.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from claims_metrics import read  # noqa: E402


def plan_summary(job: Path) -> dict | None:
    """A PGQ run's recipe in brief (None for other runs)."""
    path = job / "pgq" / "recipe.json"
    if not path.is_file():
        return None
    recipe = json.loads(path.read_text())
    return {"summary": recipe["summary"], "fraction": recipe["fraction"],
            "seed": recipe["config"]["seed"],
            "quantized": [g["name"] for g in recipe["gemms"] if g["quantized"]]}


def job_record(job: Path, metrics: list[str]) -> dict | None:
    """One finished job's kept numbers (None unless it validated at its last step)."""
    if not (job / "metrics.jsonl").is_file() or not (job / "args.json").is_file():
        return None
    records = read(job / "metrics.jsonl")
    val = [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]
    train = [r["loss"] for r in records if "loss" in r]
    last_step = json.loads((job / "args.json").read_text())["train_iters"]
    if not val or not train or val[-1][0] != last_step:
        return None
    last = {m: r[m] for r in records for m in metrics if m in r}
    return {"val_loss": val[-1][1], "val": val, "final_train_loss": train[-1],
            "max_train_loss": max(train), "metrics": last, "plan": plan_summary(job)}


def commit() -> str:
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    return head + (" (dirty)" if dirty else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("grid", type=Path, help="a compare_precision.py --out folder")
    p.add_argument("out", type=Path, help="the claim's folder (benchmarks/results/claims/X)")
    p.add_argument("--config", type=Path, required=True, help="the grid's config file")
    p.add_argument("--metric", nargs="*", default=[], help="metrics.jsonl keys to keep")
    p.add_argument("--commit", help="the code commit the grid ran at, when it is not HEAD")
    opts = p.parse_args(argv)
    runs: dict[str, dict[int, dict]] = {}
    commands = {}
    for job in sorted(opts.grid.glob("runs/*/seed_*")):
        record = job_record(job, opts.metric)
        if record is not None:
            seed = int(job.name.removeprefix("seed_"))
            runs.setdefault(job.parent.name, {})[seed] = record
            argv_ = json.loads((job / "compare_job.json").read_text())["argv"]
            commands.setdefault(job.parent.name, " ".join(argv_[1:]))
    seeds = sorted({s for per in runs.values() for s in per})
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "runs.json").write_text(json.dumps(
        {n: {str(s): v for s, v in sorted(per.items())} for n, per in runs.items()},
        indent=1) + "\n")
    columns = [*runs, *(f"{n}:{m}" for n in runs for m in opts.metric)]
    with (opts.out / "seeds.csv").open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["seed", *columns])
        for s in seeds:
            cells = [runs[n][s]["val_loss"] if s in runs[n] else "" for n in runs]
            cells += [runs[n][s]["metrics"].get(m, "") if s in runs[n] else ""
                      for n in runs for m in opts.metric]
            writer.writerow([s, *cells])
    (opts.out / "source.json").write_text(json.dumps(
        {"commit": opts.commit or commit(), "config_file": str(opts.config),
         "config": opts.config.read_text(), "commands": commands}, indent=1) + "\n")
    print(f"kept {sum(len(v) for v in runs.values())} jobs of {len(runs)} runs, seeds "
          f"{seeds} in {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
