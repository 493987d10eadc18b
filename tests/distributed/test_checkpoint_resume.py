"""Checkpoints: a SIGKILLed run resumes onto the identical loss curve; resharding on load;
a crash while saving leaves the last good checkpoint intact."""

import signal
import time

import pytest

from pretrain_runner import (FAST_ARGS, REPO, kill_group, latest_iteration, launch,
                             start_in_group, train_losses)

TRAIN = ["--train-iters", "12", "--save-interval", "4"]


def _save_args(tmp_path, name):
    return ["--run-dir", str(tmp_path / name), "--save", str(tmp_path / f"{name}-ckpt")]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted run's directory and checkpoints (saved at steps 4, 8, 12)."""
    tmp = tmp_path_factory.mktemp("full")
    launch([*FAST_ARGS, *TRAIN, *_save_args(tmp, "full")])
    return tmp


@pytest.fixture(scope="module")
def uninterrupted(full_run):
    return train_losses(full_run / "full")


def test_sigkill_then_resume_continues_identically(tmp_path, uninterrupted):
    save = tmp_path / "killed-ckpt"
    proc = start_in_group([str(REPO / "pretrain_llama.py"), *FAST_ARGS, *TRAIN,
                   *_save_args(tmp_path, "killed")], tmp_path / "killed.log")
    deadline = time.time() + 240
    while latest_iteration(save) < 4 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL
    resumed_from = latest_iteration(save)
    assert 4 <= resumed_from < 12
    launch([*FAST_ARGS, *TRAIN, "--run-dir", str(tmp_path / "resumed"), "--save",
            str(save), "--load", str(save)])
    resumed = train_losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(resumed_from + 1, 13))
    for step, loss in resumed.items():
        assert loss == uninterrupted[step], f"step {step}: {loss} != {uninterrupted[step]}"


def test_resume_at_tp2_from_tp1_checkpoint(tmp_path, full_run, uninterrupted):
    launch([*FAST_ARGS, *TRAIN, "--run-dir", str(tmp_path / "tp2"), "--no-save",
            "--load", str(full_run / "full-ckpt" / "iter_0000004"),
            "--tensor-model-parallel-size", "2"], nproc=2)
    resumed = train_losses(tmp_path / "tp2")
    assert sorted(resumed) == list(range(5, 13))
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5), f"step {step}"



def test_distributed_optimizer_resumes_exactly_at_the_same_and_another_dp_size(tmp_path):
    """megatron's distributed optimizer saved at DP=2 (its bucket format) and resumed at DP=2
    and at DP=1: both continue the uninterrupted DP=2 run bit for bit (AdamW's moments and
    step restored — a lost step shows at the first update after the resume)."""
    flags = [*FAST_ARGS, "--train-iters", "4", "--use-distributed-optimizer"]
    launch([*flags, "--save-interval", "2", *_save_args(tmp_path, "full")], nproc=2)
    full = train_losses(tmp_path / "full")
    for name, nproc in (("dp2", 2), ("dp1", 1)):
        launch([*flags, "--run-dir", str(tmp_path / name), "--no-save",
                "--load", str(tmp_path / "full-ckpt" / "iter_0000002")], nproc=nproc)
        assert train_losses(tmp_path / name) == {3: full[3], 4: full[4]}, name

PATCHED_ENTRY = """
import errno, functools, os, sys
{definitions}
if __name__ == "__main__":  # dist_checkpointing spawns workers that re-import this file
    {patch}
    from megatron_ext.training.pretrain import main
    sys.exit(main("llama"))
"""
"""pretrain_llama.py with one of megatron's checkpoint-writing functions replaced."""

CRASH_ON_SECOND_SAVE = PATCHED_ENTRY.format(definitions="""
from megatron.core import dist_checkpointing
real_save = dist_checkpointing.save
calls = []
def crashing_save(state, path, *args, **kwargs):
    calls.append(path)
    if len(calls) == 2:
        open(os.path.join(path, "__0_0.distcp"), "wb").write(b"half a shard")
        os._exit(17)  # dies mid-save, like a node failure
    return real_save(state, path, *args, **kwargs)""", patch="dist_checkpointing.save = crashing_save")


def test_crash_while_saving_keeps_last_good_checkpoint(tmp_path, uninterrupted):
    script = tmp_path / "crash_on_second_save.py"
    script.write_text(CRASH_ON_SECOND_SAVE)
    proc = start_in_group([str(script), *FAST_ARGS, *TRAIN, *_save_args(tmp_path, "crash")],
                  tmp_path / "crash.log")
    returncode = proc.wait(timeout=240)
    kill_group(proc)
    assert returncode == 17, (tmp_path / "crash.log").read_text()[-2000:]
    save = tmp_path / "crash-ckpt"
    assert latest_iteration(save) == 4
    assert not (save / "iter_0000008").exists()
    launch([*FAST_ARGS, *TRAIN, "--run-dir", str(tmp_path / "after"), "--save", str(save),
            "--load", str(save)])
    resumed = train_losses(tmp_path / "after")
    assert resumed == {s: uninterrupted[s] for s in range(5, 13)}
    assert latest_iteration(save) == 12 and not (save / ".tmp_iter_0000008").exists()


DISK_FULL_ON_SECOND_SAVE = PATCHED_ENTRY.format(definitions="""
from megatron.core.dist_checkpointing.strategies import filesystem_async
real_write = filesystem_async._write_item
@functools.wraps(real_write)  # megatron inspects its signature
def full_disk_write(*args, **kwargs):
    stream = next(a for a in args if hasattr(a, "write"))
    if "_iter_0000008" in stream.name:  # the writer process of the second save
        stream.write(b"part of a shard")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)
    return real_write(*args, **kwargs)""", patch="filesystem_async._write_item = full_disk_write")


def test_disk_full_while_saving_is_one_line_and_leaves_nothing(tmp_path, uninterrupted):
    script = tmp_path / "disk_full_on_second_save.py"
    script.write_text(DISK_FULL_ON_SECOND_SAVE)
    save = tmp_path / "full-disk-ckpt"
    proc = launch([*FAST_ARGS, *TRAIN, "--run-dir", str(tmp_path / "run"), "--save", str(save)],
                  script=str(script), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        f"error: cannot save the checkpoint of step 8 to '{save}': no space left on device (its "
        "temporary folder was removed; checkpoint 4 is intact)"]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000004",
                                                      "latest_checkpointed_iteration.txt"]
    launch([*FAST_ARGS, *TRAIN, "--run-dir", str(tmp_path / "after"), "--no-save",
            "--load", str(save)])
    assert train_losses(tmp_path / "after") == {s: uninterrupted[s] for s in range(5, 13)}


def test_finetune_takes_weights_only(tmp_path):
    from pretrain_runner import read_metrics

    evals = ["--eval-iters", "2", "--eval-interval", "6"]
    launch([*FAST_ARGS, *evals, "--train-iters", "6", *_save_args(tmp_path, "src")])
    src_val = {r["step"]: r["val_loss"] for r in read_metrics(tmp_path / "src") if "val_loss" in r}
    launch([*FAST_ARGS, *evals, "--train-iters", "2", "--finetune", "--no-save",
            "--load", str(tmp_path / "src-ckpt"), "--run-dir", str(tmp_path / "ft")])
    records = read_metrics(tmp_path / "ft")
    ft_val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert ft_val[0] == src_val[6]  # the same weights, evaluated on the same batches
    assert ft_val[0] < src_val[0]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]  # progress starts over


def test_load_into_other_vocabulary_is_refused(tmp_path, full_run):
    # megatron itself would load the embedding zero-padded (allow_shape_mismatch): never silently
    proc = launch([*FAST_ARGS, "--train-iters", "2", "--vocab-size", "1000", "--no-save",
                   "--load", str(full_run / "full-ckpt"), "--run-dir", str(tmp_path / "v1024")],
                  check=False)
    assert proc.returncode == 2
    assert "error: --load: 'embedding.word_embeddings.weight' has shape (384, 128)" in proc.stderr


def test_resume_goes_on_in_place_and_logs_the_last_step(tmp_path):
    """``--load RUN/checkpoints`` alone continues in RUN (metrics, checkpoints), as Megatron-LM's
    --save = --load; the last step is logged whatever --log-interval; a finished run says so."""
    import json

    from pretrain_runner import read_metrics

    run = tmp_path / "run"
    flags = [*FAST_ARGS, "--train-iters", "6", "--log-interval", "4"]
    launch([*flags, "--exit-interval", "3", "--run-dir", str(run)])  # saves step 3, stops
    with open(run / "metrics.jsonl", "a") as f:  # as if it had logged step 5 before dying
        f.write(json.dumps({"step": 5, "loss": -1.0}) + "\n")
    proc = launch([*flags, "--load", str(run / "checkpoints")])
    assert f"run dir {run}" in proc.stdout
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 3, 4, 6]
    assert latest_iteration(run / "checkpoints") == 6
    proc = launch([*flags, "--load", str(run / "checkpoints")])
    assert "already at step 6 of --train-iters 6: nothing to train" in proc.stdout
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 3, 4, 6]
    proc = launch([*flags[:-4], "--train-iters", "5", "--load", str(run / "checkpoints")],
                  check=False)
    assert proc.returncode == 2
    assert "error: --load: already at step 6" in proc.stderr
    assert "past --train-iters 5: nothing to train" in proc.stderr
