"""One job of a grid (a run at a seed): its directory, command, completion mark, metrics.

A job trains in ``OUT/runs/<run>/seed_<seed>``: the training script writes ``args.json`` and
``metrics.jsonl`` there, the tool writes the script's output to ``train.log`` and, once the
script exited 0 with a validation loss at its last step, ``compare_job.json`` (the command,
exit status, seconds). A job is **finished** when that mark names the same command (the
training script by its file name: a grid started from another checkout of the project reuses
it) and the metrics are complete; any other directory is broken (killed, failed, or made with other
flags) and is deleted before the job runs again.

What is read from ``metrics.jsonl`` (``megatron_ext.training.metrics``): training records
(``"loss"``) and validation records (``"val_loss"``), both with ``"step"``; the cost model's
``fp4_flop_frac`` and ``gemm_time_vs_bf16`` on training records when a precision plan is
active, and their ``mem_gib`` (peak memory since the previous record; the run's peak is the
largest). A run without them (no ``--precision``) counts as FP4 fraction 0 and GEMM time 1:
the cost model puts an operand left at the run's own precision in the BF16 class.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.io import write_text_atomic
from megatron_ext.compare.grid import Grid, RunSpec

MARKER = "compare_job.json"
"""The completion mark the tool writes into a job's directory."""
LOG = "train.log"
"""The training script's stdout and stderr."""


@dataclass(frozen=True)
class Job:
    """One run of the grid at one seed."""

    run: RunSpec
    """The run."""
    seed: int
    """Its ``--seed``."""
    dir: Path
    """``OUT/runs/<run>/seed_<seed>`` (absolute)."""
    argv: tuple[str, ...]
    """The script and its flags (the interpreter not included: the mark compares these)."""

    @property
    def tag(self) -> str:
        """``<run>/seed_<seed>``: how progress lines and errors name the job."""
        return f"{self.run.name}/seed_{self.seed}"


def make_jobs(grid: Grid, entry: Path, out: Path) -> list[Job]:
    """Every job, seed by seed (a finished seed is a complete comparison)."""
    jobs = []
    for seed in grid.seeds:
        for run in grid.runs:
            run_dir = out.resolve() / "runs" / run.name / f"seed_{seed}"
            argv = (str(entry), *grid.flags(run), "--seed", str(seed),
                    "--run-dir", str(run_dir), "--no-save")
            jobs.append(Job(run, seed, run_dir, argv))
    return jobs


def last_value(argv, flag: str) -> str | None:
    """The value ``argv`` gives ``flag`` last (``--flag V`` or ``--flag=V``; last wins, as
    argparse reads it), or None."""
    value = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


def check_scored(jobs: list[Job]) -> None:
    """``ValueError`` (one line) for a run that would train without the validation loss the
    comparison scores (``--eval-iters 0``): said before anything trains."""
    for job in jobs:
        if last_value(job.argv, "--eval-iters") == "0":
            raise ValueError(f"run {job.run.name}: --eval-iters 0 leaves no validation loss, "
                             "the score compared (give --eval-iters > 0)")


@dataclass(frozen=True)
class RunMetrics:
    """What a finished job's ``metrics.jsonl`` says."""

    train_iters: int
    """``--train-iters`` of the run (from its ``args.json``)."""
    val_loss: float
    """Validation loss at the last step: the score compared."""
    train: tuple[tuple[int, float], ...]
    """(step, training loss), step order."""
    val: tuple[tuple[int, float], ...]
    """(step, validation loss), step order."""
    fp4_final: float
    """FP4 share of linear-layer FLOPs at the last logged step (the final plan)."""
    fp4_mean: float
    """The same, averaged over the logged training steps (a plan that changes counts pro rata)."""
    gemm_time_mean: float
    """Cost-model GEMM time relative to all-BF16, averaged over the logged training steps."""
    mem_gib: float | None = None
    """Peak memory of the run: the largest ``mem_gib`` of its training records (rank 0; peak
    RSS on CPU, allocated on GPU); None if no record has one."""


def _series(records: list[dict], key: str) -> tuple[tuple[int, float], ...]:
    """(step, value) of every record with a finite ``key``; a repeated step: the last one."""
    by_step = {r["step"]: float(r[key]) for r in records
               if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])}
    return tuple(sorted(by_step.items()))


def _records(path: Path) -> list[dict]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read '{path}': {exc}") from None
    if not all(isinstance(r, dict) and isinstance(r.get("step"), int) for r in records):
        raise ValueError(f"'{path}': a record is not an object with an integer \"step\"")
    return records


def read_metrics(run_dir: Path) -> RunMetrics:
    """The metrics of a complete run; ``ValueError`` (one line) if missing or incomplete."""
    try:
        train_iters = json.loads((run_dir / "args.json").read_text())["train_iters"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"'{run_dir / 'args.json'}': no train_iters ({exc})") from None
    records = _records(run_dir / "metrics.jsonl")
    val = _series(records, "val_loss")
    if not val or val[-1][0] != train_iters:
        raise ValueError(f"'{run_dir}': no validation loss at the last step {train_iters} "
                         "(did it finish? is --eval-iters > 0?)")
    steps = [r for r in records if "loss" in r]
    if not steps:
        raise ValueError(f"'{run_dir}': no training records")
    fp4 = [float(r.get("fp4_flop_frac", 0.0)) for r in steps]
    time = [float(r.get("gemm_time_vs_bf16", 1.0)) for r in steps]
    mem = [value for _, value in _series(steps, "mem_gib")]
    return RunMetrics(train_iters, val[-1][1], _series(records, "loss"), val, fp4[-1],
                      sum(fp4) / len(fp4), sum(time) / len(time), max(mem) if mem else None)


def is_finished(job: Job) -> bool:
    """Marked finished with the same command, and its metrics complete."""
    try:
        mark = json.loads((job.dir / MARKER).read_text())
        read_metrics(job.dir)
    except (OSError, ValueError):
        return False
    return _command(mark.get("argv")) == _command(job.argv) and mark.get("returncode") == 0


def _command(argv) -> list[str] | None:
    """``argv`` with the training script by its file name (not where the checkout lies)."""
    if not isinstance(argv, (list, tuple)) or not argv:
        return None
    return [Path(argv[0]).name, *argv[1:]]


def mark_finished(job: Job, seconds: float) -> None:
    """Write the completion mark (after the metrics were found complete)."""
    mark = {"argv": list(job.argv), "returncode": 0, "seconds": round(seconds, 1)}
    write_text_atomic(job.dir / MARKER, json.dumps(mark, indent=1) + "\n")
