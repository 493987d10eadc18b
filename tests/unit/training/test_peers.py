"""A lost peer is one line and exit status 2 whichever reaches this rank first: the failed
collective, or the launcher's SIGTERM while this rank is still computing (torchrun tears the
job down as soon as it sees a dead worker). Without a dead peer SIGTERM means what it did."""

import signal
import subprocess
import sys

import pytest

LINE = ("error: lost rank 1 (its process ended); stopping this rank (resume from the last "
        "checkpoint with --load)")

SCRIPT = """
import os, signal, socket, subprocess, sys, time
from megatron_ext.training import peers
peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"
                         if sys.argv[1] == "dying" else "pass"])
if sys.argv[1] == "dead":
    peer.wait()  # rank 1's process has ended
peers._PEERS.table = [(socket.gethostname(), os.getpid()), (socket.gethostname(), peer.pid)]
peers._PEERS.timeout_minutes = 10.0
peers.dist.get_rank = lambda: 0
if sys.argv[2] == "handler":
    signal.signal(signal.SIGTERM, lambda *_: print("previous handler ran", flush=True))
with peers.peer_loss_reported():
    if sys.argv[2] == "raise":
        raise RuntimeError("[../third_party/gloo/...] Connection closed by peer [127.0.0.1]:1")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
print("after the block", flush=True)
peer.kill()
"""


def _run(peer: str, how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, peer, how], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("how", ["raise", "sigterm", "handler"])
def test_a_dead_peer_is_one_line_and_status_2(how):
    done = _run("dead", how)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [LINE]
    assert "after the block" not in done.stdout and "previous handler" not in done.stdout


def test_a_peer_still_dying_when_its_connection_closes_is_named():
    """The socket closes before ``/proc`` shows the process ended (a race seen under load):
    the report waits for it, up to ``peers.SETTLE_S``."""
    done = _run("dying", "raise")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [LINE]


def test_sigterm_without_a_dead_peer_ends_the_process_as_before():
    done = _run("alive", "sigterm")
    assert done.returncode == -signal.SIGTERM and "error:" not in done.stderr


def test_sigterm_without_a_dead_peer_reaches_the_previous_handler():
    done = _run("alive", "handler")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["previous handler ran", "after the block"]
