"""Launch the real entry points in tests (single process, or torchrun on gloo) and read runs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Small, fast, deterministic: 5 steps of the tiny Llama on mock data, logging every step.
FAST_ARGS = ["--mock-data", "--log-interval", "1", "--lr-warmup-iters", "1", "--eval-iters", "0",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "64"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args: list[str], nproc: int = 1, family: str = "llama", timeout: int = 300,
           check: bool = True, script: str | None = None) -> subprocess.CompletedProcess:
    """Run pretrain_<family>.py (or ``script``, a path under the repository) with ``args``;
    under torchrun (gloo) when nproc > 1."""
    script = str(REPO / (script or f"pretrain_{family}.py"))
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def latest_iteration(save_dir) -> int:
    """The iteration ``save_dir``'s latest-checkpoint pointer names (0 if none yet)."""
    try:
        return int((Path(save_dir) / "latest_checkpointed_iteration.txt").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def start_in_group(argv: list[str], log_path) -> subprocess.Popen:
    """Start ``python argv`` in its own process group (with the checkpoint writer's helper
    processes), output to ``log_path`` (a pipe nobody reads could block it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    # A job started in the background (`pytest &`) inherits SIGINT ignored, and exec keeps an
    # ignored signal ignored (a handled one it resets): handle it here while the child starts,
    # so that Ctrl-C tests send it to a trainer with Python's default handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with open(log_path, "w") as log:
            return subprocess.Popen([sys.executable, *argv], env=env, cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the whole job, like a node failure (also reaps orphaned helper processes)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_for(condition, proc: subprocess.Popen, seconds: float = 240) -> None:
    """Poll ``condition()`` until it holds; fail if ``proc`` ends or time runs out first."""
    deadline = time.time() + seconds
    while not condition() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert condition(), "the run ended or stalled before the expected point"


def logged_steps(run_dir) -> int:
    """The last training step ``run_dir``'s metrics hold (0 before the first)."""
    try:
        return max(train_losses(run_dir), default=0)
    except FileNotFoundError:
        return 0


def torchrun_worker(agent_pid: int, rank: int):
    """The psutil.Process of torchrun ``agent_pid``'s worker with global rank ``rank``."""
    import psutil

    agent = psutil.Process(agent_pid)
    for _ in range(600):
        for child in agent.children():
            try:
                if child.environ().get("RANK") == str(rank):
                    return child
            except psutil.Error:
                pass
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} worker under torchrun")
