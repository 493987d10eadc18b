"""Helpers for the precision tests (not a conftest.py: pytest would let it shadow the
top-level ``conftest`` module that other test directories import from).

* ``megatron_world`` — a fixture: a one-process megatron world (gloo, TP = PP = 1) for
  building real megatron modules in-process;
* :func:`launch_precision` — run ``pretrain_precision.py`` (the Llama entry point with the
  precision extension), single-process or under torchrun on gloo.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[3]
PRETRAIN = Path(__file__).with_name("pretrain_precision.py")

# as tests/conftest.py's FAST_ARGS: tiny Llama, mock data, 8 sequences of 64 tokens a step
FAST = ["--mock-data", "--log-interval", "1", "--lr-warmup-iters", "1", "--eval-iters", "0",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "64"]


@pytest.fixture(scope="module")
def megatron_world():
    from megatron.core import parallel_state, tensor_parallel

    from megatron_ext.compat import cpu
    from megatron_ext.training.distributed import LaunchInfo, init_process_group

    cpu.activate()
    init_process_group(LaunchInfo("single", 0, 1, 0, "127.0.0.1", 0))
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    cpu.deactivate()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_precision(args, nproc: int = 1, check: bool = True, timeout: int = 300,
                     script: Path = PRETRAIN) -> subprocess.CompletedProcess:
    """Run ``script`` with ``args``; under torchrun (gloo) when ``nproc > 1``."""
    cmd = [sys.executable, str(script), *map(str, args)]
    if nproc > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                    "--master-port", str(_free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc
