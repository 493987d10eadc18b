"""The hook contract's seams through the real entry point: an extension builds and wraps the
optimizer, sees training start and end, and stops the run cleanly (checkpoint saved)."""

from pathlib import Path

import pytest

from megatron_ext.extension import Extension, the_one
from pretrain_runner import FAST_ARGS, latest_iteration, launch, read_metrics, train_losses

PROBE = Path(__file__).with_name("pretrain_seams.py")
PARAM_PROBE = Path(__file__).with_name("pretrain_param_seam.py")


def test_optimizer_stop_and_lifecycle_seams(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = launch([*FAST_ARGS, "--train-iters", "6", "--save", str(ckpt), "--run-dir",
                   str(tmp_path / "run")], script=PROBE)
    assert "probe: start at step 0" in proc.stdout
    assert "probe: end at step 3, optimizers built 1, optimizer steps 3" in proc.stdout
    assert sorted(train_losses(tmp_path / "run")) == [1, 2, 3]
    assert latest_iteration(ckpt) == 3  # a stop saves, like SIGTERM


def test_only_one_extension_may_provide_the_optimizer():
    one = Extension("a", build_optimizer=lambda *a: "opt-a")
    silent = Extension("b", build_optimizer=lambda *a: None)
    assert the_one([one, silent], "build_optimizer", 1, 2, 3) == "opt-a"
    assert the_one([silent], "build_optimizer", 1, 2, 3) is None
    with pytest.raises(ValueError, match="several extensions provide build_optimizer: a, c"):
        the_one([one, Extension("c", build_optimizer=lambda *a: "opt-c")], "build_optimizer",
                1, 2, 3)


def test_a_parameter_added_after_model_is_trained(tmp_path):
    """``after_model`` runs before DDP and the optimizer: the probe's gain (no weight decay)
    moves with its gradient from step 2 on (step 1 trains at warm-up's learning rate 0)."""
    launch([*FAST_ARGS, "--train-iters", "3", "--no-save", "--run-dir", str(tmp_path)],
           script=PARAM_PROBE)
    gains = [r["probe_gain"] for r in read_metrics(tmp_path) if "probe_gain" in r]
    assert gains[0] == 1.0 and len(set(gains)) == 3, gains
