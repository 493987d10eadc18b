"""The same job under mpiexec (mpich from PyPI, ranks via mpi4py) trains like torchrun does."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain_runner import FAST_ARGS, REPO, free_port, train_losses

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed (pip install mpich mpi4py)")
def test_mpiexec_tp2_matches_single_process(run_pretrain, tmp_path):
    steps = ["--train-iters", "3", "--no-save"]
    single = train_losses(run_pretrain("single", steps))
    run_dir = tmp_path / "mpi"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "MASTER_PORT": str(free_port())}
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(REPO / "pretrain_llama.py"),
                           *FAST_ARGS, *steps, "--tensor-model-parallel-size", "2",
                           "--run-dir", str(run_dir)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TP=2" in proc.stdout  # both processes joined one job, not two single runs
    losses = train_losses(run_dir)
    assert losses.keys() == single.keys()
    for step, loss in single.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5)
