"""Helper processes die with their trainer.

megatron-core's checkpoint writer starts helper processes: a multiprocessing Manager (started
with ``spawn`` at the first save, ~450 MB: it re-imports the entry point) that serves its
results queue, and at every save one ``fork``ed writer per bucket of tensors. A hard kill of
the trainer (``kill -9``, the OOM killer, a node agent) used to leave them behind, reparented
to PID 1: the Manager (and multiprocessing's ``resource_tracker``, which waits for it) for
good, and a writer caught mid-save finished into the dead run's temporary folder and then
blocked forever on its results queue.

Linux's parent-death signal fixes this at the source: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` in
a child makes the kernel kill it the moment the thread that started it ends, however that
ends. :func:`install` (once per trainer, before training) sets it

* in every ``fork``ed child of the trainer, through ``os.register_at_fork`` (the writers);
* in the Manager, which it starts itself, before megatron would, with an initializer
  (the Manager also ignores SIGTERM and SIGINT, so a SLURM pre-emption or a Ctrl-C that
  signals every process of the job cannot break the final save; see docs/faults.md).

``resource_tracker`` then exits on its own: it ends when the last process holding its pipe
does. Elsewhere than Linux a watchdog thread in the child polls the parent instead (1 s).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.managers
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_forking_pid: int | None = None
"""The pid that forked, noted just before each fork (the child inherits the value)."""


def _parent_death_signal() -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)`` for this process; False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def die_with_parent(parent_pid: int) -> None:
    """In a child of ``parent_pid``: end when it ends (at once if it already has)."""
    if not _parent_death_signal():
        threading.Thread(target=_watch, args=(parent_pid,), daemon=True,
                         name="parent-watchdog").start()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _note_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(_forking_pid)


def _manager_init(parent_pid: int) -> None:
    """Runs in the spawned Manager before it serves."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which decides


def _start_writer_queue() -> None:
    """megatron's checkpoint-writer results queue, served by a Manager that dies with us.
    A megatron-core without this module-level queue (or one already started) is left alone."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", False) is not None:
        return
    manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_manager_init, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


_installed = False


def install(saves_checkpoints: bool) -> None:
    """Make every helper process of this trainer die with it (see the module docstring).
    Idempotent; start it from the main thread (the parent-death signal follows the thread)."""
    global _installed
    if not _installed:
        os.register_at_fork(before=_note_forking_pid, after_in_child=_after_fork_in_child)
        _installed = True
    if saves_checkpoints:
        _start_writer_queue()
