"""The README's main job, shortened: `python pretrain_llama.py` on the embedded corpus."""

import json
import math

import pytest

from pretrain_runner import launch, read_metrics


def test_default_run_shortened(tmp_path):
    run_dir = tmp_path / "default"
    proc = launch(["--train-iters", "30", "--eval-interval", "15", "--eval-iters", "4",
                   "--run-dir", str(run_dir), "--tensorboard-dir", str(tmp_path / "tb")],
                  timeout=600)
    assert "validation at step 30" in proc.stdout
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    vals = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert [r["step"] for r in steps] == [1, 10, 20, 30]
    for r in steps:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(r)
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    assert sorted(vals) == [0, 15, 30]
    # BPE vocabulary of 4096: the untrained model sits near ln(4096) = 8.3
    assert abs(vals[0] - math.log(4096)) < 0.5
    assert vals[30] < vals[0] - 1.0, vals
    val_record = next(r for r in records if r.get("step") == 30 and "val_ppl" in r)
    assert val_record["val_ppl"] == pytest.approx(math.exp(vals[30]), rel=1e-9)
    args = json.loads((run_dir / "args.json").read_text())
    assert args["model"] == "tiny" and args["train_iters"] == 30
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
    assert (ckpt / "iter_0000030" / "metadata.json").is_file()
    _assert_tensorboard_has(tmp_path / "tb", steps)


def _assert_tensorboard_has(tb_dir, steps):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir))
    events.Reload()
    scalars = {e.step: e.value for e in events.Scalars("loss")}
    assert scalars == pytest.approx({r["step"]: r["loss"] for r in steps}, rel=1e-6)
    assert {"val_loss", "lr", "tokens_per_s"} <= set(events.Tags()["scalars"])
