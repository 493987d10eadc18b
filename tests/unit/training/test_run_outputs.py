"""Outputs are checked before any work: a bad --run-dir / --save / --tensorboard-dir costs one
line and exit status 2 at start-up, and leaves nothing behind."""

import os

import pytest

from pretrain_runner import FAST_ARGS, launch
from megatron_ext.errors import UsageError
from megatron_ext.io import check_output


@pytest.fixture
def blocker(tmp_path):
    """A regular file: any folder asked for under it cannot be created."""
    path = tmp_path / "a_file"
    path.write_text("x")
    return path


def _snapshot(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("flag, where, message", [
    ("--run-dir", "blocker/run", "--run-dir: cannot write"),
    ("--save", "blocker/ckpt", "--save: cannot write"),
    ("--save", "blocker", "--save: cannot write"),
    ("--tensorboard-dir", "blocker/tb", "--tensorboard-dir: cannot write"),
])
def test_bad_output_stops_before_any_step(tmp_path, blocker, flag, where, message):
    path = str(blocker) + where.removeprefix("blocker")
    run_dir = ["--run-dir", str(tmp_path / "run")] if flag != "--run-dir" else []
    before = _snapshot(tmp_path)
    proc = launch([*FAST_ARGS, "--train-iters", "2", *run_dir, flag, path], check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "step " not in proc.stdout  # nothing trained
    assert _snapshot(tmp_path) == before  # no run folder, no checkpoint folder


def test_check_output_kinds(tmp_path, blocker):
    check_output(str(tmp_path / "new" / "deeper"), "--x")  # missing folders: fine, not made
    assert not (tmp_path / "new").exists()
    check_output(str(tmp_path / "plan.json"), "--x", kind="file")
    with pytest.raises(UsageError, match=r"--x: cannot write '.*a_file': '.*a_file' is a file, not a folder"):
        check_output(str(blocker), "--x")
    with pytest.raises(UsageError, match="is a folder, not a file"):
        check_output(str(tmp_path), "--x", kind="file")
    with pytest.raises(UsageError, match="folder '.*no' does not exist"):
        check_output(str(tmp_path / "no" / "plan.json"), "--x", kind="file")
    with pytest.raises(UsageError, match=r"cannot create files in '/proc'"):
        check_output("/proc/no_such_run", "--x")
    assert os.listdir(tmp_path) == ["a_file"]  # the probes left nothing


def test_a_resume_of_a_save_root_writes_in_place(tmp_path):
    """--load ROOT (its latest checkpoint) saves into ROOT and logs into the run folder above
    it; one iter_* folder (a branch), --finetune, or explicit --save / --run-dir do not."""
    from megatron_ext.training.arguments import parse_args

    run = tmp_path / "runs" / "ts"
    iter_dir = run / "checkpoints" / "iter_0000004"
    iter_dir.mkdir(parents=True)
    (iter_dir / "metadata.json").write_text("{}")
    (run / "args.json").write_text("{}")
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4\n")

    def outputs(*flags):
        args = parse_args("llama", [*FAST_ARGS, *flags], world_size=1)
        return args.run_dir, args.save

    root = str(run / "checkpoints")
    assert outputs("--load", root) == (str(run), root)
    assert outputs("--load", root, "--save", str(tmp_path / "s")) == (str(run), str(tmp_path / "s"))
    assert outputs("--load", root, "--run-dir", str(tmp_path / "r"))[1] == root
    for other in (["--load", str(iter_dir)], ["--load", root, "--finetune"]):
        run_dir, save = outputs(*other)
        assert run_dir.startswith("runs") and save == os.path.join(run_dir, "checkpoints")
    (run / "args.json").unlink()  # a save root that is no run's: a new run folder, same root
    run_dir, save = outputs("--load", root)
    assert run_dir.startswith("runs") and save == root
