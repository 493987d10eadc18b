"""Overlays do not depend on hook order (issue 24, item 1): an outside method, appended after
GNMR, replaces the base plan BF16 -> FP4 before step 3; under ``--gnmr --gnmr-rule
first-last --gnmr-topk 1`` GNMR's promotion of block L0 is lifted from the *new* base at the
same commit, so step 3 already runs L0 in FP8 (``--gnmr-high auto``: FP4 one class up)."""

from pathlib import Path

from pretrain_runner import FAST_ARGS, launch, read_metrics

PROBE = Path(__file__).with_name("base_switch_probe.py")


def test_a_base_set_after_gnmr_is_promoted_at_the_same_step(tmp_path):
    launch([*FAST_ARGS, "--train-iters", "3", "--no-save", "--run-dir", str(tmp_path),
            "--precision", "uniform:bf16", "--gnmr", "--gnmr-rule", "first-last",
            "--gnmr-topk", "1", "--num-layers", "4"], script=PROBE)
    steps = {r["step"]: r for r in read_metrics(tmp_path) if "loss" in r}
    assert steps[2]["fp4_flop_frac"] == 0.0 and steps[2]["bf16_flop_frac"] == 1.0
    # step 3: layers L1-L3 in FP4 (the new base), L0 promoted to FP8, no BF16 left
    assert steps[3]["bf16_flop_frac"] == 0.0
    assert abs(steps[3]["fp8_flop_frac"] - 0.25) < 1e-9, steps[3]
    assert abs(steps[3]["fp4_flop_frac"] - 0.75) < 1e-9, steps[3]
    assert sorted(steps[3]["precision_changed_sites"]) == sorted(
        f"L{layer}.{s}" for layer in range(4) for s in ("qkv", "proj", "fc1", "fc2"))
