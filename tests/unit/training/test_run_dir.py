"""One run folder per launch, owned by one run at a time (training/run_dir.py), and a launch
environment no launcher made refused in seconds (training/distributed.py)."""

import argparse
import fcntl
import json
import re

import pytest

from pretrain_runner import free_port
from megatron_ext.errors import UsageError
from megatron_ext.training import run_dir as rd
from megatron_ext.training.distributed import LaunchInfo, _rendezvous, check_launch_env


@pytest.fixture(autouse=True)
def _released():
    yield
    rd.release()


def _args(folder, load=None):
    return argparse.Namespace(run_dir=str(folder), save=str(folder / "checkpoints"), load=load)


def test_a_new_run_into_a_finished_runs_folder_is_refused(tmp_path):
    (tmp_path / "args.json").write_text(json.dumps({"train_iters": 3}))
    with pytest.raises(UsageError, match=r"^--run-dir '.*' already holds a run: pass --load "
                                         r".*checkpoints to resume it, or another --run-dir"):
        rd.claim_run_dir(_args(tmp_path))
    rd.claim_run_dir(_args(tmp_path, load=str(tmp_path / "checkpoints")))  # a resume goes on


def test_a_folder_whose_run_is_alive_is_refused_even_to_a_resume(tmp_path):
    rd.claim_run_dir(_args(tmp_path / "run"))  # this process's run holds the lock
    assert "pid" in (tmp_path / "run" / rd.LOCK).read_text()
    refusal = rd._lock(str(tmp_path / "run"), resuming=True)  # another open file: a conflict
    assert re.search(r"is in use by a running job \(pid \d+ on .*\): wait for it", refusal)
    rd.release()  # the run ended (a crash drops the lock the same way)
    with open(tmp_path / "run" / rd.LOCK) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_fresh_folder_is_claimed_and_created(tmp_path):
    args = _args(tmp_path / "a" / "b")
    rd.claim_run_dir(args)
    assert (tmp_path / "a" / "b" / rd.LOCK).is_file()
    assert args.run_dir == str(tmp_path / "a" / "b")


@pytest.mark.parametrize("env,fragment", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK=0 WORLD_SIZE=2 are set but MASTER_ADDR is not"),
])
def test_stale_launch_environment_is_one_line(env, fragment):
    with pytest.raises(UsageError, match=fragment + ".*unset them to train in one process"):
        check_launch_env(env)


def test_launcher_environments_pass():
    check_launch_env({})
    check_launch_env({"RANK": "0", "WORLD_SIZE": "1"})
    check_launch_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    check_launch_env({"WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                      "SLURM_JOB_NODELIST": "node1"})


@pytest.mark.parametrize("rank,fragment", [(0, "the other ranks did not join"),
                                           (1, "rank 0 is not listening")])
def test_hand_launched_rank_alone_gives_up_in_seconds(rank, fragment):
    port = free_port()
    info = LaunchInfo("torchrun", rank, 2, 0, "127.0.0.1", port)
    with pytest.raises(UsageError, match=f"rank {rank} of WORLD_SIZE=2: {fragment} at "
                                         f"MASTER_ADDR=127.0.0.1:{port} within 1 s"):
        _rendezvous(info, port, 1)


def test_a_converted_model_is_not_resumed_in_place(tmp_path):
    from megatron_ext.training.checkpointing import CONVERTED_SPEC, TRACKER, resume_in_place

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "args.json").write_text("{}")
    (run / "checkpoints" / TRACKER).write_text("3\n")
    assert resume_in_place(str(run / "checkpoints"), False) == (str(run),
                                                                 str(run / "checkpoints"))
    converted = tmp_path / "llama-mg"  # hf-to-megatron's output: its own run folder, not here
    converted.mkdir()
    (converted / TRACKER).write_text("0\n")
    (converted / CONVERTED_SPEC).write_text("{}")
    assert resume_in_place(str(converted), False) == (None, None)
