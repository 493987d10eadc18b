"""``--gaussws all`` under TP=2 and TP=2 x PP=2 (torchrun on gloo) against one process on the
same global batches: ŵ of every site equals the TP=1 weight's bit for bit (the shards
reassembled, tiles cut by shard edges included: fc2's 5.5 tiles per rank, the fused SwiGLU
fc1), and the losses and per-site b_t statistics agree to float32 summation order.

No precision plan: the linears pass their operands through, so the layouts differ only by
summation order (a quantized plan would turn those differences into rounding flips)."""

from pathlib import Path

import pytest
import torch

from pretrain_runner import FAST_ARGS, launch, read_metrics

PROBE = Path(__file__).with_name("gaussws_probe.py")
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}


def _run(run_dir, nproc, flags):
    launch([*FAST_ARGS, "--train-iters", "3", "--no-save", "--run-dir", str(run_dir),
            "--gaussws", "all", *flags], nproc=nproc, timeout=900, script=PROBE)
    records = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}
    return records, _full_w_hat(run_dir)


def _full_w_hat(run_dir) -> dict[str, torch.Tensor]:
    """Every site's full ŵ, put together from the ranks' shards."""
    full = {}
    for path in sorted(Path(run_dir).glob("w_hat_rank*.pt")):
        for sid, (local, row_ranges, (c0, c1), shape) in torch.load(path).items():
            out = full.setdefault(sid, torch.full(shape, float("nan")))
            offset = 0
            for lo, hi in row_ranges:
                out[lo:hi, c0:c1] = local[offset:offset + hi - lo]
                offset += hi - lo
    return full


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("gaussws_single") / "run", 1, [])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_samples_the_single_process_weights(single, layout, tmp_path):
    nproc, flags = LAYOUTS[layout]
    (records1, w_hat1), (records_n, w_hat_n) = single, _run(tmp_path / layout, nproc, flags)
    assert sorted(w_hat1) == sorted(w_hat_n) and len(w_hat1) == 16
    for sid, ref in w_hat1.items():
        assert torch.equal(w_hat_n[sid], ref), sid  # no NaN left: every element placed
    assert sorted(records1) == sorted(records_n) == [1, 2, 3]
    worst = 0.0
    for step, ref in records1.items():
        keys = ["loss"] + [k for k in ref if k.startswith("gaussws_b_")]
        assert len(keys) == 1 + 16 * 3 and set(keys) <= set(records_n[step])
        for key in keys:
            worst = max(worst, abs(records_n[step][key] - ref[key]) / abs(ref[key]))
    print(f"{layout}: worst relative difference {worst:.2e}")
    assert worst < 1e-5, worst
