"""--optimizer stquant-adamw under megatron's layouts: DP=2 without and TP=2 x DP=2 with the
distributed optimizer assign the same widths as one process at every update and train the same
losses (to a tolerance: see below); each resumes bit for bit from its codes + scales
checkpoint (BF16 weights too); a checkpoint is refused, in one line, under another layout."""

import json

import pytest

from pretrain_runner import FAST_ARGS, launch, read_metrics, train_losses

STQUANT = ["--optimizer", "stquant-adamw", "--train-iters", "6"]
LAYOUTS = {"dp2": (2, []),
           "tp2-dp2-distopt": (4, ["--tensor-model-parallel-size", "2",
                                   "--use-distributed-optimizer"])}


def widths(run_dir) -> list[dict]:
    with open(run_dir / "stquant_widths.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process, then each layout with a checkpoint at step 3."""
    tmp = tmp_path_factory.mktemp("stquant")
    launch([*FAST_ARGS, *STQUANT, "--no-save", "--run-dir", str(tmp / "single")])
    for name, (nproc, flags) in LAYOUTS.items():
        launch([*FAST_ARGS, *STQUANT, *flags, "--save-interval", "3", "--run-dir",
                str(tmp / name), "--save", str(tmp / f"{name}-ckpt")], nproc=nproc)
    return tmp


def test_single_process_run_changes_widths_and_saves_memory(runs):
    assigned = widths(runs / "single")
    assert [w["step"] for w in assigned] == [1, 2, 3, 4]  # t < 5, then every 10
    assert {b for w in assigned for b in w["widths"].values()} >= {4, 8}
    last = read_metrics(runs / "single")[-1]
    assert last["stquant_state_bytes_per_param"] < 2.0  # FP32 AdamW: 8
    assert 4 <= last["stquant_avg_bits"] < 8


# One process and the layouts differ in FP32 summation order (1e-5 relative for the FP32
# optimizer, test_parallel_equivalence) and, under TP, in the blocks of row-parallel weights
# whose local rows are not a multiple of the block (fc2: 176 of 352 columns). A 4-bit code is
# 1/14 of a block's maximum, so a rounding that flips one code moves a weight by a visible
# step: after 6 steps the losses agree to ~5e-4 (measured 3.4e-4 for TP2 x DP2).
LOSS_TOLERANCE = 2e-3


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_assigns_the_same_widths_and_trains_the_same_losses(runs, name):
    assert widths(runs / name) == widths(runs / "single")
    single = train_losses(runs / "single")
    losses = train_losses(runs / name)
    assert sorted(losses) == sorted(single) == list(range(1, 7))
    for step, loss in single.items():
        assert losses[step] == pytest.approx(loss, rel=LOSS_TOLERANCE), f"step {step}"
    assert abs(single[6] - single[1]) > 0.5  # it trains


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_from_the_quantized_checkpoint_is_bit_exact(runs, name):
    nproc, flags = LAYOUTS[name]
    resumed = runs / f"{name}-resumed"
    launch([*FAST_ARGS, *STQUANT, *flags, "--no-save", "--run-dir", str(resumed),
            "--load", str(runs / f"{name}-ckpt" / "iter_0000003")], nproc=nproc)
    uninterrupted = train_losses(runs / name)
    assert train_losses(resumed) == {s: uninterrupted[s] for s in (4, 5, 6)}
    assert widths(resumed) == [w for w in widths(runs / name) if w["step"] > 3]


def test_another_layout_is_refused_in_one_line(runs):
    proc = launch([*FAST_ARGS, *STQUANT, "--no-save", "--run-dir", str(runs / "refused"),
                   "--load", str(runs / "tp2-dp2-distopt-ckpt")], check=False)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --load: cannot read checkpoint") and "optimizer.stquant" in last


def test_bf16_distributed_optimizer_resumes_bit_exact(tmp_path):
    # BF16 weights: the FP32 main copies are saved beside the codes and restored too
    flags = [*FAST_ARGS, *STQUANT, "--bf16", "--use-distributed-optimizer"]
    launch([*flags, "--save-interval", "3", "--run-dir", str(tmp_path / "full"), "--save",
            str(tmp_path / "ckpt")], nproc=2)
    launch([*flags, "--no-save", "--run-dir", str(tmp_path / "resumed"), "--load",
            str(tmp_path / "ckpt" / "iter_0000003")], nproc=2)
    full = train_losses(tmp_path / "full")
    assert train_losses(tmp_path / "resumed") == {s: full[s] for s in (4, 5, 6)}
