"""TP / PP / DP / VP / SP layouts train the same model: losses of the first steps agree (fp32).

The reference is the single-process run; each layout is a real torchrun job on gloo.
"""

import pytest

from pretrain_runner import train_losses

STEPS = ["--train-iters", "5", "--no-save"]

LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    # the reference runs the default sdpa core attention: megatron-core's local one at TP=2
    "tp2-local-attention": (2, ["--tensor-model-parallel-size", "2", "--attention-backend",
                                "local"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2-distopt": (2, ["--use-distributed-optimizer"]),
    "tp2-pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2-vp": (2, ["--pipeline-model-parallel-size", "2",
                   "--num-layers-per-virtual-pipeline-stage", "1"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from pretrain_runner import FAST_ARGS, launch
    run_dir = tmp_path_factory.mktemp("ref") / "single"
    launch([*FAST_ARGS, *STEPS, "--run-dir", str(run_dir)])
    return train_losses(run_dir)


def _assert_close(losses: dict, reference: dict) -> None:
    assert sorted(losses) == sorted(reference) == [1, 2, 3, 4, 5]
    for step, ref in reference.items():
        assert losses[step] == pytest.approx(ref, rel=1e-5), f"step {step}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, run_pretrain):
    nproc, flags = LAYOUTS[name]
    _assert_close(train_losses(run_pretrain(name, [*STEPS, *flags], nproc=nproc)), reference)


def test_training_actually_changes_the_loss(reference):
    # guards the comparison above against a run that never updates the weights
    assert abs(reference[5] - reference[1]) > 1e-3


def test_gpt_tied_embeddings_pp2_matches_single(run_pretrain):
    single = train_losses(run_pretrain("gpt1", STEPS, family="gpt"))
    _assert_close(train_losses(run_pretrain("gpt-pp2", [*STEPS, "--pipeline-model-parallel-size",
                                                         "2"], nproc=2, family="gpt")), single)
