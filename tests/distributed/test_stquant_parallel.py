"""--optimizer stquant-adamw under megatron's layouts: DP=2 without and DP=2, TP=2 x DP=2 with
the distributed optimizer assign the same widths as one process at every update and train the
same losses (to a tolerance: see below); each resumes bit for bit from its codes + scales
checkpoint (BF16 weights too). The DP=2 distributed-optimizer checkpoint loads at DP=1 with
the saved state bit for bit and at DP=4 within half a quantization step, and both continue
the run; another TP size and the earlier per-rank format are refused in one line."""

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing

from megatron_ext.methods.stquant.quantizer import QState, dequantize
from megatron_ext.training.checkpoint_integrity import write_manifest
from pretrain_runner import FAST_ARGS, launch, read_metrics, train_losses

STQUANT = ["--optimizer", "stquant-adamw", "--train-iters", "6"]
LAYOUTS = {"dp2": (2, []),
           "dp2-distopt": (2, ["--use-distributed-optimizer"]),
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
# step: after 6 steps the losses agree to ~5e-4 (measured 3.3e-4 for TP2 x DP2, 1e-6 for DP2).
LOSS_TOLERANCE = 2e-3
# resumed at DP 1 / 4 from DP 2: summation order (+ DP 4's cut blocks); measured 2.4e-8 / 2.7e-7
RESHARD_TOLERANCE = 1e-5


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_assigns_the_same_widths_and_trains_the_same_losses(runs, name):
    assert widths(runs / name) == widths(runs / "single")
    single = train_losses(runs / "single")
    losses = train_losses(runs / name)
    assert sorted(losses) == sorted(single) == list(range(1, 7))
    for step, loss in single.items():
        assert losses[step] == pytest.approx(loss, rel=LOSS_TOLERANCE), f"step {step}"
    assert abs(single[6] - single[1]) > 0.5  # it trains


# dp2-distopt's resume at DP 2 is test_bf16_distributed_optimizer_resumes_bit_exact (and at
# DP 1 test_dp1_restores_the_dp2_state_bit_for_bit): not launched a third time here
@pytest.mark.parametrize("name", ["dp2", "tp2-dp2-distopt"])
def test_resume_from_the_quantized_checkpoint_is_bit_exact(runs, name):
    nproc, flags = LAYOUTS[name]
    resumed = runs / f"{name}-resumed"
    launch([*FAST_ARGS, *STQUANT, *flags, "--no-save", "--run-dir", str(resumed),
            "--load", str(runs / f"{name}-ckpt" / "iter_0000003")], nproc=nproc)
    uninterrupted = train_losses(runs / name)
    assert train_losses(resumed) == {s: uninterrupted[s] for s in (4, 5, 6)}
    assert widths(resumed) == [w for w in widths(runs / name) if w["step"] > 3]


def _last_line(proc) -> str:
    assert proc.returncode == 2
    return proc.stderr.strip().splitlines()[-1]


def test_another_tp_size_is_refused_in_one_line(runs):
    proc = launch([*FAST_ARGS, *STQUANT, "--no-save", "--run-dir", str(runs / "refused"),
                   "--load", str(runs / "tp2-dp2-distopt-ckpt")], check=False)
    assert _last_line(proc) == (
        "error: --load: the STQuant optimizer state was saved at TP 2 x PP 1, this run is "
        "TP 1 x PP 1; it reshards over DP only (--finetune loads the weights)")


def test_the_per_rank_format_is_refused_in_one_line(runs, tmp_path):
    old = tmp_path / "iter_0000003"  # the common state as the per-rank format wrote it
    shutil.copytree(runs / "dp2-ckpt" / "iter_0000003", old)
    common = torch.load(old / "common.pt", weights_only=False)
    stquant = common["optimizer"]["stquant"]
    common["optimizer"]["stquant"] = {"allocator": stquant["allocator"],
                                      "layout": {**stquant["layout"], "distributed": False}}
    torch.save(common, old / "common.pt")
    write_manifest(str(old))
    proc = launch([*FAST_ARGS, *STQUANT, "--no-save", "--run-dir", str(tmp_path / "run"),
                   "--load", str(old)], check=False)
    assert "earlier per-rank format" in _last_line(proc)


# ------------------------------------------------- the DP=2 checkpoint loaded at DP=1 and DP=4

def saved_state(ckpt) -> dict[str, dict]:
    """Per parameter of a checkpoint: its widths and its m, v (dequantized) and main copy over
    the whole parameter, the saved slices joined (read in one process, no STQuant code)."""
    table = dist_checkpointing.load_common_state_dict(str(ckpt))["optimizer"]["stquant"]["table"]
    objects = {f"{key}/shard_{i}_{len(t['slices'])}": None
               for key, t in table.items() for i in range(len(t["slices"]))}
    dcp.load(objects, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    out = {}
    for key, t in table.items():
        pieces = [objects[f"{key}/shard_{i}_{len(t['slices'])}"][0]  # megatron saves [data]
                  for i in range(len(t["slices"]))]
        joined = {}
        for name in ("exp_avg", "exp_avg_sq", "main"):
            if pieces[0][name] is None:
                continue
            values = [dequantize(QState.from_dict(p[name])) if isinstance(p[name], dict)
                      else p[name] for p in pieces]
            joined[name] = torch.cat(values)
        first = pieces[0]["exp_avg"]
        joined["bits"] = first["bits"] if isinstance(first, dict) else 32
        out[key] = joined
    return out


@pytest.fixture(scope="module")
def resaved(runs):
    """The DP=2 distributed-optimizer checkpoint of step 3 loaded at DP=1 and DP=4, saved
    again at once, and trained on from there to step 6."""
    ckpt = runs / "dp2-distopt-ckpt" / "iter_0000003"
    for nproc in (1, 4):
        launch([*FAST_ARGS, *STQUANT, "--use-distributed-optimizer", "--load", str(ckpt),
                "--run-dir", str(runs / f"dp{nproc}-from-dp2"), "--save",
                str(runs / f"resave{nproc}-ckpt")], nproc=nproc,
               script="tests/distributed/stquant_resave_worker.py")
    return {nproc: saved_state(runs / f"resave{nproc}-ckpt" / "iter_0000003")
            for nproc in (1, 4)}


def test_dp1_restores_the_dp2_state_bit_for_bit(runs, resaved):
    saved = saved_state(runs / "dp2-distopt-ckpt" / "iter_0000003")
    assert saved.keys() == resaved[1].keys()
    assert {s["bits"] for s in saved.values()} >= {4, 8}
    for key, state in saved.items():
        assert state.keys() == resaved[1][key].keys()
        for name, value in state.items():
            assert (value == resaved[1][key][name] if name == "bits"
                    else torch.equal(value, resaved[1][key][name])), (key, name)


# DP=4 cuts blocks (its ranges start at multiples of 32): those are requantized, m within half
# the new step (<= max|m| / 2Q of the parameter), v whole rungs (float32 rounding only).
# Measured on this run: see docs/stquant.md.
def test_dp4_restores_the_dp2_state_within_half_a_step(runs, resaved):
    saved = saved_state(runs / "dp2-distopt-ckpt" / "iter_0000003")
    moved = 0
    for key, state in saved.items():
        got = resaved[4][key]
        assert got["bits"] == state["bits"]
        if state["bits"] == 32:
            assert torch.equal(got["exp_avg"], state["exp_avg"]), key
            continue
        m_err = (got["exp_avg"] - state["exp_avg"]).abs().max()
        assert m_err <= state["exp_avg"].abs().max() / (2 ** state["bits"] - 2) * 1.0001, key
        moved += int(m_err > 0)
        v, v_new = state["exp_avg_sq"], got["exp_avg_sq"]
        assert torch.equal(v == 0, v_new == 0)
        assert torch.allclose(v_new, v, rtol=1e-6, atol=0), key
    assert moved > 0  # some blocks were cut and requantized


@pytest.mark.parametrize("nproc", [1, 4])
def test_resumed_at_another_dp_size_continues_the_run(runs, resaved, nproc):
    uninterrupted = train_losses(runs / "dp2-distopt")
    resumed = train_losses(runs / f"dp{nproc}-from-dp2")
    assert sorted(resumed) == [4, 5, 6]
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=RESHARD_TOLERANCE), step


def test_bf16_distributed_optimizer_resumes_bit_exact(tmp_path):
    # BF16 weights: the FP32 main copies are saved beside the codes and restored too
    flags = [*FAST_ARGS, *STQUANT, "--bf16", "--use-distributed-optimizer"]
    launch([*flags, "--save-interval", "3", "--run-dir", str(tmp_path / "full"), "--save",
            str(tmp_path / "ckpt")], nproc=2)
    launch([*flags, "--no-save", "--run-dir", str(tmp_path / "resumed"), "--load",
            str(tmp_path / "ckpt" / "iter_0000003")], nproc=2)
    full = train_losses(tmp_path / "full")
    assert train_losses(tmp_path / "resumed") == {s: full[s] for s in (4, 5, 6)}
