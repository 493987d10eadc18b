"""Faults through the real entry points: rank desync under torchrun, SIGTERM pre-emption (one
process, and one rank of two), kill -9 in the middle of a save, and corrupt or crafted
checkpoint files at --load."""

import os
import shutil
import signal

import pytest
import torch

from pretrain_runner import (FAST_ARGS, REPO, free_port, kill_group, latest_iteration, launch,
                             logged_steps, start_in_group, torchrun_worker, train_losses,
                             wait_for)
from megatron_ext.training.checkpoint_integrity import MANIFEST, write_manifest


def test_rank_desync_aborts_every_rank_before_saving(tmp_path):
    save = tmp_path / "ckpt"
    proc = launch([*FAST_ARGS, "--train-iters", "2", "--run-dir", str(tmp_path / "run"),
                   "--save", str(save), "--inject-desync-on-rank", "1"], nproc=2, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank desync at the checkpoint save of step 2: consumed_samples "
                      "differs on rank(s) 1 (rank 0: 16, rank 1: 17) -- stopping all ranks"]
    assert not list(save.glob("*iter_*"))  # nothing written, not even a temp directory


@pytest.mark.parametrize("sig,status", [("SIGTERM", 0), ("SIGINT", 130)])
def test_stop_signal_saves_a_checkpoint_and_exits_cleanly(tmp_path, sig, status):
    """SIGTERM (pre-emption) and Ctrl-C (SIGINT: exit status 130) save and stop, one line."""
    save, run_dir = tmp_path / "ckpt", tmp_path / "run"
    proc = start_in_group([str(REPO / "pretrain_llama.py"), *FAST_ARGS, "--train-iters", "1000",
                   "--save-interval", "1", "--run-dir", str(run_dir), "--save", str(save)],
                  tmp_path / "run.log")
    try:
        wait_for(lambda: latest_iteration(save) >= 1, proc)  # the writer's helper processes are up
        os.killpg(proc.pid, getattr(signal, sig))  # like SLURM / a terminal: every process
        returncode = proc.wait(timeout=120)
    finally:
        kill_group(proc)
    log = (tmp_path / "run.log").read_text()
    assert returncode == status, log[-3000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    stopped = logged_steps(run_dir)
    assert f"received {sig}: stopping after step {stopped}, saving a checkpoint" in log
    if sig == "SIGINT":
        assert log.rstrip().endswith(f"interrupted (Ctrl-C): stopped after step {stopped}, "
                                     "checkpoint saved")
    assert 1 <= stopped < 1000 and latest_iteration(save) == stopped
    launch([*FAST_ARGS, "--train-iters", str(stopped + 1), "--lr-decay-iters", "1000",
            "--run-dir", str(tmp_path / "resumed"), "--no-save", "--load", str(save)])
    assert sorted(train_losses(tmp_path / "resumed")) == [stopped + 1]


def test_ctrl_c_without_the_handler_is_one_line_and_status_130(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_in_group([str(REPO / "pretrain_llama.py"), *FAST_ARGS, "--train-iters", "1000",
                           "--run-dir", str(run_dir), "--no-save"], tmp_path / "run.log")
    try:
        wait_for(lambda: logged_steps(run_dir) >= 1, proc)
        os.killpg(proc.pid, signal.SIGINT)
        returncode = proc.wait(timeout=120)
    finally:
        kill_group(proc)
    log = (tmp_path / "run.log").read_text()
    assert returncode == 130, log[-3000:]
    assert "Traceback" not in log and log.rstrip().endswith("interrupted (Ctrl-C)"), log[-3000:]


def test_sigterm_to_one_rank_stops_all_ranks_after_the_same_step(tmp_path):
    save, run_dir = tmp_path / "ckpt", tmp_path / "run"
    proc = start_in_group(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(free_port()), str(REPO / "pretrain_llama.py"), *FAST_ARGS,
                   "--train-iters", "1000", "--run-dir", str(run_dir), "--save", str(save)],
                  tmp_path / "run.log")
    try:
        rank1 = torchrun_worker(proc.pid, 1)
        wait_for(lambda: logged_steps(run_dir) >= 2, proc)
        rank1.send_signal(signal.SIGTERM)  # rank 0 learns it through the all-reduce
        returncode = proc.wait(timeout=120)
    finally:
        kill_group(proc)
    log = (tmp_path / "run.log").read_text()
    assert returncode == 0, log[-3000:]  # torchrun saw both ranks exit 0
    stopped = logged_steps(run_dir)
    assert f"received SIGTERM: stopping after step {stopped}" in log
    assert latest_iteration(save) == stopped and (save / f"iter_{stopped:07d}" / MANIFEST).is_file()


PAUSE_IN_SECOND_SAVE = """
import os, sys, time
from megatron.core import dist_checkpointing
real_save = dist_checkpointing.save
calls = []
def pausing_save(state, path, *args, **kwargs):
    result = real_save(state, path, *args, **kwargs)
    calls.append(path)
    if len(calls) == 2:  # shards written; checksums, rename and pointer still to come
        open(os.environ["SAVE_PAUSED_MARKER"], "w").close()
        time.sleep(600)
    return result
if __name__ == "__main__":  # dist_checkpointing spawns workers that re-import this file
    dist_checkpointing.save = pausing_save
    from megatron_ext.training.pretrain import main
    sys.exit(main("llama"))
"""


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    script, marker = tmp_path / "pause_in_second_save.py", tmp_path / "paused"
    script.write_text(PAUSE_IN_SECOND_SAVE)
    monkeypatch.setenv("SAVE_PAUSED_MARKER", str(marker))
    save = tmp_path / "ckpt"
    train = [*FAST_ARGS, "--train-iters", "2", "--save-interval", "1", "--save", str(save)]
    proc = start_in_group([str(script), *train, "--run-dir", str(tmp_path / "run")], tmp_path / "run.log")
    try:
        wait_for(marker.exists, proc)
    finally:
        kill_group(proc)  # SIGKILL to the trainer and the writer's helper processes
    assert proc.returncode == -signal.SIGKILL
    assert latest_iteration(save) == 1 and not (save / "iter_0000002").exists()
    assert list((save / ".tmp_iter_0000002").iterdir())  # the half-done save is there
    launch([*train, "--run-dir", str(tmp_path / "resumed"), "--load", str(save)])
    assert sorted(train_losses(tmp_path / "resumed")) == [2]
    assert latest_iteration(save) == 2 and not (save / ".tmp_iter_0000002").exists()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    launch([*FAST_ARGS, "--train-iters", "2", "--run-dir", str(tmp / "run"), "--save",
            str(tmp / "ckpt")])
    return tmp / "ckpt" / "iter_0000002"


def _load(ckpt, tmp_path):
    return launch([*FAST_ARGS, "--train-iters", "3", "--no-save", "--load", str(ckpt),
                   "--run-dir", str(tmp_path / "run")], check=False)


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def test_corrupt_checkpoint_file_is_named_at_load(checkpoint, tmp_path):
    ckpt = shutil.copytree(checkpoint, tmp_path / "iter_0000002")
    shard = ckpt / "__0_1.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the middle of the file
    shard.write_bytes(bytes(data))
    assert _one_error_line(_load(ckpt, tmp_path)) == (
        f"error: --load: checkpoint file '{shard}' is corrupt (its sha256 differs from "
        f"{MANIFEST})")


class RunsCode:
    """Unpickling this calls ``os.mkdir(marker)``: a stand-in for any code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_crafted_common_pt_is_refused_without_running_it(checkpoint, tmp_path):
    ckpt, marker = shutil.copytree(checkpoint, tmp_path / "iter_0000002"), tmp_path / "marker"
    common = torch.load(ckpt / "common.pt", weights_only=True)
    torch.save({**common, "scheduler": RunsCode(marker)}, ckpt / "common.pt")
    os.remove(ckpt / MANIFEST)
    write_manifest(str(ckpt))  # its maker would make the checksums match
    line = _one_error_line(_load(ckpt, tmp_path))
    assert line.startswith(f"error: --load: refusing '{ckpt / 'common.pt'}': it names "
                           "posix.mkdir, and unpickling it could run code")
    assert not marker.exists()
