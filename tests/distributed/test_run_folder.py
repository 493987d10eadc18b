"""The README's parallel line without --run-dir, its ranks started seconds apart: one run
folder whose checkpoint loads (each rank used to name runs/<timestamp> from its own clock and
scatter the shards); then a new run into that folder is refused in one line."""

import os
import subprocess
import sys
import time

from pretrain_runner import FAST_ARGS, REPO, free_port, launch, train_losses


def _start_rank(rank: int, port: int, argv: list[str], cwd, log) -> subprocess.Popen:
    """Rank ``rank`` of 2, started by hand as a launcher would (no torchrun agent)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RANK": str(rank),
           "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen([sys.executable, str(REPO / "pretrain_llama.py"), *argv], env=env,
                            cwd=cwd, stdout=log, stderr=subprocess.STDOUT)


def test_ranks_started_seconds_apart_write_one_run_folder_that_loads(tmp_path):
    steps = ["--lr-decay-iters", "10"]  # one schedule for the run and its resume
    argv = [*FAST_ARGS, *steps, "--train-iters", "2", "--tensor-model-parallel-size", "2"]
    port, procs, logs = free_port(), [], []
    for rank in range(2):
        logs.append(open(tmp_path / f"rank{rank}.log", "w"))
        procs.append(_start_rank(rank, port, argv, tmp_path, logs[-1]))
        time.sleep(2.5)  # rank 1's clock reads a later second than rank 0's
    codes = [p.wait(timeout=400) for p in procs]
    for log in logs:
        log.close()
    out = (tmp_path / "rank0.log").read_text()
    assert codes == [0, 0], out[-3000:] + (tmp_path / "rank1.log").read_text()[-3000:]
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 1, folders  # one run folder, every shard in it
    run_dir = folders[0]
    assert f"saved checkpoint runs/{run_dir.name}/checkpoints/iter_0000002" in out
    # it loads (every file its checksums.json lists is there) and training goes on from it
    launch([*FAST_ARGS, *steps, "--train-iters", "3", "--load", str(run_dir / "checkpoints")])
    assert sorted(train_losses(run_dir)) == [1, 2, 3]
    # a new run (no --load) into that run's folder: one line, exit 2, the folder untouched
    proc = launch([*FAST_ARGS, "--train-iters", "2", "--run-dir", str(run_dir)], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: --run-dir '{run_dir}' already holds a run: pass --load "
        f"{run_dir / 'checkpoints'} to resume it, or another --run-dir to start a new one"]
    assert sorted(train_losses(run_dir)) == [1, 2, 3]
