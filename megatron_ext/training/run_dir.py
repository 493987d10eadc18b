"""One run folder per launch, owned by one run at a time.

* **Agreed by every rank.** The default ``runs/<timestamp>`` comes from each process's own
  clock, so ranks started in different seconds would name different folders and scatter one
  checkpoint's shards over them. :func:`claim_run_dir` (collective, right after the process
  group exists) gives every rank rank 0's ``--run-dir`` and ``--save``.
* **One run at a time.** Rank 0 holds an exclusive ``fcntl`` lock on ``<run-dir>/.lock`` for
  the life of the process (the kernel drops it when the process ends, crashed or not). A second
  run into a folder whose run is alive is refused, and so is a new run (no ``--load``) into a
  folder that already holds a run (``args.json`` or ``metrics.jsonl``): mixing two runs'
  metrics, arguments and checkpoints there would lose both.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import time

import torch.distributed as dist

from megatron_ext.errors import UsageError

LOCK = ".lock"
RUN_FILES = ("args.json", "metrics.jsonl")
"""Files whose presence means the folder holds a run."""

_HELD: list = []
"""The open lock file of this process's run folder (kept open: closing it drops the lock)."""


def default_run_dir() -> str:
    """``runs/<timestamp>`` from this process's clock (:func:`claim_run_dir` makes it one)."""
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def holds_run(run_dir: str) -> bool:
    """Whether ``run_dir`` already holds a run's outputs."""
    return any(os.path.isfile(os.path.join(run_dir, name)) for name in RUN_FILES)


def _occupied(run_dir: str) -> str:
    return (f"--run-dir '{run_dir}' already holds a run: pass --load "
            f"{os.path.join(run_dir, 'checkpoints')} to resume it, or another --run-dir to "
            "start a new one")


def _lock(run_dir: str, resuming: bool) -> str | None:
    """Take ``run_dir``'s lock (rank 0); the one-line refusal, or None."""
    if not resuming and holds_run(run_dir):
        return _occupied(run_dir)
    created = _missing_folders(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    handle = open(os.path.join(run_dir, LOCK), "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        return (f"--run-dir '{run_dir}' is in use by a running job ({owner}): wait for it to "
                "end, or pass another --run-dir")
    if not resuming and holds_run(run_dir):  # written while this process took the lock
        handle.close()
        return _occupied(run_dir)
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    handle.flush()
    _HELD.append(handle)
    atexit.register(_remove_if_unused, run_dir, created)
    return None


def _missing_folders(path: str) -> list[str]:
    """The folders ``os.makedirs(path)`` would create, deepest first."""
    missing, path = [], os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_if_unused(run_dir: str, created: list[str]) -> None:
    """At exit: a run that failed before writing anything leaves no folder behind (only its
    lock would be in it)."""
    try:
        if os.listdir(run_dir) != [LOCK]:
            return
        os.remove(os.path.join(run_dir, LOCK))
        for folder in created:
            os.rmdir(folder)
    except OSError:
        pass


def release() -> None:
    """Drop this process's run-folder lock (process exit does the same)."""
    while _HELD:
        _HELD.pop().close()


def claim_run_dir(args) -> None:
    """Every rank takes rank 0's ``args.run_dir`` / ``args.save``; rank 0 locks the folder.
    ``UsageError`` on every rank if the folder is taken. Collective once torch.distributed is
    initialized; call it before anything writes into the folder."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    problem = _lock(args.run_dir, bool(args.load)) if rank0 else None
    shared = [args.run_dir, args.save, problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(shared, src=0)
    args.run_dir, args.save, problem = shared
    if problem:
        raise UsageError(problem)
