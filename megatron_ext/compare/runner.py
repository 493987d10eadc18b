"""Running a grid's jobs: ``--jobs`` training processes at a time, one thread each.

Finished jobs (:func:`megatron_ext.compare.jobs.is_finished`) are reused; every other job's
directory is deleted and the job trained again, as a child process ``python ENTRY FLAGS
--seed S --run-dir DIR --no-save`` with ``OMP_NUM_THREADS=1`` in the current directory,
its output in ``DIR/train.log``. A progress line per finished job goes to stderr with the
time so far and the ETA: the mean wall time per finished job times the jobs left (the jobs
run ``--jobs`` at a time, so this counts parallel progress correctly once the first wave
is done). A failed job does not stop the others; the caller reports the failures.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from megatron_ext.compare.jobs import LOG, Job, is_finished, mark_finished, read_metrics
from megatron_ext.training.metrics import format_duration


def say(line: str) -> None:
    """One whole line on stderr (one write: lines of parallel jobs do not interleave)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class Progress:
    """Counts finished jobs and estimates the time left."""

    def __init__(self, total: int):
        self.total = total
        """Jobs to run in this invocation."""
        self.done = 0
        """Jobs ended so far (finished or failed)."""
        self.start = time.time()
        """Wall-clock start of the first job."""
        self._lock = threading.Lock()

    def report(self, job: Job, outcome: str) -> None:
        """Count ``job`` as ended and print ``[k/n] tag: outcome | elapsed | ETA``."""
        with self._lock:
            self.done += 1
            elapsed = time.time() - self.start
            left = elapsed / self.done * (self.total - self.done)
            say(f"[{self.done}/{self.total}] {job.tag}: {outcome} | elapsed "
                f"{format_duration(elapsed)} | ETA {format_duration(left)}")


def train(job: Job) -> str | None:
    """Train one job from scratch; None on success, else why it failed (one line)."""
    shutil.rmtree(job.dir, ignore_errors=True)
    job.dir.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.time()
    with open(job.dir / LOG, "w", encoding="utf-8") as log:
        proc = subprocess.run([sys.executable, *job.argv], stdout=log, stderr=subprocess.STDOUT,
                              env=env, check=False)
    if proc.returncode != 0:
        return f"exit status {proc.returncode}, see {job.dir / LOG}"
    try:
        read_metrics(job.dir)
    except ValueError as exc:
        return str(exc)
    mark_finished(job, time.time() - start)
    return None


def check_flags(jobs: list[Job], parallel: int) -> list[str]:
    """Each run's command (one job per run: its seeds differ only in ``--seed``) through its
    own entry point with ``--check-flags`` (every flag parsed and validated, nothing
    started), ``parallel`` at a time; one ``run NAME: why`` line per run refused."""
    firsts = list({job.run.name: job for job in reversed(jobs)}.values())[::-1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

    def one(job: Job) -> str | None:
        proc = subprocess.run([sys.executable, *job.argv, "--check-flags"], env=env,
                              capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            return None
        errors = [line.removeprefix("error: ") for line in proc.stderr.splitlines()
                  if line.startswith("error: ")]
        return f"run {job.run.name}: {errors[-1] if errors else f'exit status {proc.returncode}'}"

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return [error for error in pool.map(one, firsts) if error]


def run_jobs(jobs: list[Job], parallel: int) -> list[str]:
    """Train every job not finished yet, ``parallel`` at a time; returns one line per
    failed job (empty: all finished)."""
    todo = [job for job in jobs if not is_finished(job)]
    say(f"{len(jobs)} jobs: {len(jobs) - len(todo)} finished before (reused), {len(todo)} to "
        f"run, {parallel} at a time")
    progress = Progress(len(todo))

    def one(job: Job) -> str | None:
        t0 = time.time()
        error = train(job)
        if error:
            progress.report(job, f"FAILED ({error})")
            return f"{job.tag}: {error}"
        val_loss = read_metrics(job.dir).val_loss
        progress.report(job, f"val loss {val_loss:.4f} in {time.time() - t0:.0f} s")
        return None

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return [error for error in pool.map(one, todo) if error]
