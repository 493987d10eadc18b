"""--load trusts only what it can verify: a checkpoint without checksums.json needs
--load-unverified, and a wrong --load path says precisely what is wrong with it."""

import shutil

import pytest

from pretrain_runner import FAST_ARGS, launch


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-step run's save root (pointer -> iter_0000002)."""
    root = tmp_path_factory.mktemp("trust")
    launch([*FAST_ARGS, "--train-iters", "2", "--save", str(root / "ckpt"),
            "--run-dir", str(root / "run")])
    return root / "ckpt"


def _one_error(proc, fragment):
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def _resume(load, tmp_path, *extra):
    return launch([*FAST_ARGS, "--train-iters", "3", "--lr-decay-iters", "2", "--load",
                   str(load), "--no-save", "--run-dir", str(tmp_path / "run"), *extra],
                  check=False)


def test_checkpoint_without_checksums_needs_load_unverified(saved, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(saved, old)
    (old / "iter_0000002" / "checksums.json").unlink()
    _one_error(_resume(old, tmp_path), "has no checksums.json, so a corrupt file would load "
                                       "silently; pass --load-unverified")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    proc = _resume(old, tmp_path, "--load-unverified")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loading '" in proc.stdout and "unverified (--load-unverified)" in proc.stdout
    assert "step      3/3" in proc.stdout  # resumed at step 2


@pytest.mark.parametrize("case, fragment", [
    ("dangling pointer", "latest_checkpointed_iteration.txt is dangling: it names iteration "
                         "9, but '"),
    ("a file", "is a file; give a checkpoint folder"),
])
def test_wrong_load_path_says_what_is_wrong(saved, tmp_path, case, fragment):
    if case == "dangling pointer":
        load = tmp_path / "moved"
        shutil.copytree(saved, load)
        (load / "latest_checkpointed_iteration.txt").write_text("9\n")
    else:
        load = saved / "iter_0000002" / "metadata.json"
    _one_error(_resume(load, tmp_path), fragment)
