"""--save-retain N keeps the newest N checkpoints (the one just saved always among them)."""

import pytest

from pretrain_runner import FAST_ARGS, latest_iteration, launch
from megatron_ext.training.arguments import parse_args
from megatron_ext.training.checkpointing import prune_checkpoints
from megatron_ext.errors import UsageError


def _iters(root):
    return sorted(p.name for p in root.iterdir())


def test_prune_keeps_the_newest(tmp_path):
    for i in (10, 20, 30, 40):
        (tmp_path / f"iter_{i:07d}").mkdir()
        (tmp_path / f"iter_{i:07d}" / "common.pt").write_text("x")
    (tmp_path / ".deleting_iter_0000005").mkdir()  # left by a crash mid-delete
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40\n")
    assert prune_checkpoints(str(tmp_path), 40, 2) == [20, 10]
    assert _iters(tmp_path) == ["iter_0000030", "iter_0000040",
                                "latest_checkpointed_iteration.txt"]


def test_prune_never_removes_the_checkpoint_just_saved(tmp_path):
    # --finetune restarts at step 0: the new checkpoint has the lowest number
    for i in (0, 400, 800):
        (tmp_path / f"iter_{i:07d}").mkdir()
    assert prune_checkpoints(str(tmp_path), 0, 2) == [400]
    assert _iters(tmp_path) == ["iter_0000000", "iter_0000800"]


def test_flag_range():
    with pytest.raises(UsageError, match="--save-retain must be >= 1"):
        parse_args("llama", ["--save-retain", "0"], world_size=1)


def test_through_pretrain(tmp_path):
    save = tmp_path / "ckpt"
    launch([*FAST_ARGS, "--train-iters", "4", "--save-interval", "1", "--save-retain", "2",
            "--save", str(save), "--run-dir", str(tmp_path / "run")])
    assert _iters(save) == ["iter_0000003", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert latest_iteration(save) == 4


def test_a_full_disk_is_recognised_however_it_is_reported(tmp_path, monkeypatch):
    import errno
    import shutil
    from collections import namedtuple

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from megatron_ext.training import checkpointing

    enospc = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("Worker failure: ...")
    wrapped.__cause__ = enospc
    assert checkpointing._no_space(CheckpointException("save", {0: _wrap_exception(wrapped)}), str(tmp_path))
    pickled = RuntimeError("Worker failure: [Errno 28] No space left on device: 'x.distcp'")
    assert checkpointing._no_space(CheckpointException("save", {0: _wrap_exception(pickled)}), "/")
    # torch's zip writer: "unexpected pos", no errno; the free space tells
    zip_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    assert not checkpointing._no_space(zip_error, str(tmp_path))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(30 << 20, 30 << 20, 4096))
    assert checkpointing._no_space(zip_error, str(tmp_path))
