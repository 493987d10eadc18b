"""TP=2 equals TP=1 with the real collectives: ``gaussws_tp_worker.py`` under torchrun
(2 ranks, gloo) compares ŵ bit for bit, dL/dw exactly and dL/db_i to float summation order."""

import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("gaussws_tp_worker.py")
REPO = Path(__file__).resolve().parents[4]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_tp2_shards_equal_tp1_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.count(": ok") == 2, proc.stdout
