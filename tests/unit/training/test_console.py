"""What a new user sees: no warning at all on stderr (GPU libraries, megatron's index cache,
torch deprecations; in the trainer and the checkpoint writer's helper process), and the
start-up line in plain English."""

import os
import subprocess
import sys

import pytest

from pretrain_runner import FAST_ARGS, REPO


@pytest.mark.parametrize("global_batch, phrase", [("2", "| 1 micro-batch/step |"),
                                                   ("8", "| 4 micro-batches/step |")])
def test_start_up_line_and_no_gpu_library_warnings(tmp_path, global_batch, phrase):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    args = list(FAST_ARGS)  # a flag given twice is refused: replace FAST_ARGS' batch
    args[args.index("--global-batch-size") + 1] = global_batch
    proc = subprocess.run(
        [sys.executable, str(REPO / "pretrain_llama.py"), *args, "--train-iters", "2",
         "--run-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=180,
        env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved checkpoint" in proc.stdout  # the writer's helper process ran too
    assert phrase in proc.stdout
    assert "Transformer Engine and Apex" not in proc.stdout
    assert proc.stderr == ""  # megatron_ext/quiet.py: mock data, a save, Python's warnings on


def test_resuming_prints_no_warning(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    run = [sys.executable, str(REPO / "pretrain_llama.py"), *FAST_ARGS, "--train-iters", "2"]
    first = subprocess.run([*run, "--run-dir", str(tmp_path / "a")], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    proc = subprocess.run([*run[:-1], "3", "--run-dir", str(tmp_path / "b"),
                           "--load", str(tmp_path / "a" / "checkpoints"),
                           "--override-opt_param-scheduler"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step      3/3" in proc.stdout and proc.stderr == ""  # no torch FutureWarning


def test_exit_interval_says_why_the_run_stops_early(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_llama.py"), *FAST_ARGS,
                           "--train-iters", "3", "--exit-interval", "2", "--no-save",
                           "--run-dir", str(tmp_path / "run")], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("stopping at step 2 of --train-iters 3: --exit-interval "
                                         "2 (--no-save: nothing saved)"), proc.stdout[-2000:]
