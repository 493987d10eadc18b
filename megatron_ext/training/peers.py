"""A lost or stalled peer ends the job with one line naming it, not two tracebacks.

When one rank of a job dies (``kill -9``, the OOM killer, a crash), the others learn it from
their next collective: gloo raises ``Connection closed by peer [127.0.0.1]:19863`` -- an
address, not a rank -- and every survivor prints a 40-line traceback before the launcher
tears the job down. A stalled rank (a hung file system, a stopped process) is worse: the
others wait in the collective until ``--distributed-timeout-minutes`` (Megatron-LM's flag,
default 10) and then raise ``Timed out``.

:func:`record_peers` all-gathers every rank's host and pid once, right after the process
group is up. :func:`peer_loss_reported` wraps a run: a communication error becomes one
``error:`` line that names the ranks on this host whose process is gone (or stopped), printed
by the lowest surviving rank, and exit status 2. Ranks on other hosts cannot be inspected
from here; the launcher's own report names them.

The launcher races the collective: torchrun notices a dead worker within a fraction of a
second and sends SIGTERM to the others, which may still be computing, far from the
collective that would fail. So inside the block SIGTERM first looks for a dead peer on this
host; if there is one it is the same one line and exit status 2, otherwise the signal goes
on to whatever handler was there before (the default one ends the process).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

_CONNECTION_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|[Tt]imed out|"
                              r"[Tt]imeout|NCCL communicator was aborted|remote process exit")
"""What gloo and NCCL say when a peer is gone or silent."""
_TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")
"""The part of :data:`_CONNECTION_LOST` that means a silent peer, not a closed connection."""
SETTLE_S = 2.0
"""Seconds a closed connection waits for its dead peer to show in ``/proc`` (then: "lost a
peer on another host")."""


class _Peers:
    """Where every rank runs, recorded at start-up."""

    def __init__(self):
        self.table: list[tuple[str, int]] = []
        """(hostname, pid) of each rank."""
        self.timeout_minutes: float | None = None
        """The process group's timeout."""


_PEERS = _Peers()


def record_peers(timeout_minutes: float) -> None:
    """All-gather (hostname, pid) of every rank. Collective; call it once after init."""
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, (socket.gethostname(), os.getpid()))
    _PEERS.table, _PEERS.timeout_minutes = table, timeout_minutes


def _state(pid: int) -> str:
    """The process' state letter from /proc (``""`` if gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "" if not _exists(pid) else "?"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lost_ranks() -> tuple[list[int], list[int]]:
    """(ranks on this host whose process is gone, ranks on this host that are stopped)."""
    host = socket.gethostname()
    gone, stopped = [], []
    for rank, (peer_host, pid) in enumerate(_PEERS.table):
        if peer_host != host or pid == os.getpid():
            continue
        state = _state(pid)
        if state in ("", "Z", "X"):
            gone.append(rank)
        elif state in ("T", "t"):
            stopped.append(rank)
    return gone, stopped


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def settled_lost_ranks(error: str) -> tuple[list[int], list[int]]:
    """:func:`lost_ranks`, given up to :data:`SETTLE_S` to show a peer whose connection
    closed (``error`` not a timeout): a killed process closes its sockets before ``/proc``
    shows it ended, so the first look can come too early."""
    gone, stopped = lost_ranks()
    deadline = time.monotonic() + SETTLE_S
    while not (gone or stopped or _TIMED_OUT.search(error)) and time.monotonic() < deadline:
        time.sleep(0.05)
        gone, stopped = lost_ranks()
    return gone, stopped


def describe(error: str, lost: tuple[list[int], list[int]] | None = None) -> str:
    """The one line for a communication error whose message is ``error`` (``lost``: the
    (gone, stopped) ranks when already looked up)."""
    gone, stopped = lost if lost is not None else settled_lost_ranks(error)
    timed_out = _TIMED_OUT.search(error) is not None
    if gone:
        what = f"lost {_ranks(gone)} (its process ended)"
    elif stopped:
        what = f"{_ranks(stopped)} stopped (its process is suspended)"
    else:
        what = "lost a peer on another host" if not timed_out else "a peer stopped answering"
    if timed_out:
        what += f": no answer within --distributed-timeout-minutes {_PEERS.timeout_minutes:g}"
    return f"{what}; stopping this rank (resume from the last checkpoint with --load)"


def _is_peer_loss(exc: BaseException) -> bool:
    return (bool(_PEERS.table) and isinstance(exc, RuntimeError)
            and _CONNECTION_LOST.search(str(exc)) is not None)


def _report_and_exit(error: str) -> None:
    """Print the one line (lowest surviving rank only) and end this process with status 2."""
    lost = settled_lost_ranks(error)
    if dist.get_rank() == min(set(range(len(_PEERS.table))) - set(lost[0])):
        print(f"error: {describe(error, lost)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)


def _sigterm_checks_peers(previous):
    """A SIGTERM handler: a dead peer on this host -> the one line; else ``previous``."""
    def on_sigterm(signum, frame):
        if _PEERS.table and lost_ranks()[0]:
            _report_and_exit("")
        if callable(previous):
            previous(signum, frame)
        else:  # the default (or ignore): re-deliver the signal under it
            signal.signal(signal.SIGTERM, previous)
            signal.raise_signal(signal.SIGTERM)
    return on_sigterm


@contextmanager
def peer_loss_reported():
    """Turn a lost or stalled peer inside the block into one ``error:`` line (from the lowest
    surviving rank) and exit status 2 at once: the process group is broken, nothing after
    this point (checkpoint writes, process-group teardown) could complete. A SIGTERM that
    arrives while a peer on this host is dead (the launcher tearing the job down) is the same."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = (signal.getsignal(signal.SIGTERM) or signal.SIG_DFL) if in_main else None
    if in_main:
        signal.signal(signal.SIGTERM, _sigterm_checks_peers(previous))
    try:
        yield
    except Exception as exc:  # noqa: BLE001 -- filtered right below
        if not _is_peer_loss(exc):
            raise
        _report_and_exit(str(exc))
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
