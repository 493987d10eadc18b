"""``--fp8-execution real`` in a 20-step training run on CPU (torch runs per-tensor and per-row
``_scaled_mm`` there) against the same plan emulated: the losses agree to the FP32 rounding
that separates the two GEMMs, compounded over the steps."""

import json
from pathlib import Path

import pytest

from megatron_ext.precision.plan import PrecisionPlan, save_plan
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.sites import SITES, site_id
from precision_helpers import FAST, launch_precision

COUNTING = Path(__file__).with_name("pretrain_count_fp8.py")

STEPS = 20


def _plan() -> PrecisionPlan:
    """Layers 0-1 per tensor (E4M3), layers 2-3 per row with E5M2 gradients."""
    tensor = SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e4m3")
    row = SiteFormats("fp8_e4m3@row", "fp8_e4m3@row", "fp8_e5m2@row")
    return PrecisionPlan({site_id(i, s): tensor if i < 2 else row for i in range(4)
                          for s in SITES}, method="fp8-tensor-row")


def _losses(tmp_path, execution):
    plan_file = tmp_path / "plan.json"
    save_plan(_plan(), str(plan_file))
    run_dir = tmp_path / execution
    proc = launch_precision([*FAST, "--train-iters", STEPS, "--run-dir", run_dir, "--no-save",
                             "--precision-plan", plan_file, "--fp8-execution", execution],
                            script=COUNTING)
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        records = [r for r in map(json.loads, f) if "loss" in r]
    return [r["loss"] for r in records], proc.stdout


def test_real_fp8_training_agrees_with_emulated(tmp_path):
    real, out_real = _losses(tmp_path, "real")
    emulated, out_emulated = _losses(tmp_path, "emulated")
    assert "FP8 GEMMs real (torch._scaled_mm) on CPU for tensorxtensor, rowxrow" in out_real
    assert "FP8 GEMMs emulated (--fp8-execution emulated)" in out_emulated
    assert len(real) == len(emulated) == STEPS
    # 16 sites x 3 GEMMs x 4 micro-batches a step, all on FP8 data; none when emulated
    assert f"real FP8 GEMMs: {16 * 3 * 4 * STEPS}" in out_real
    assert "real FP8 GEMMs: 0" in out_emulated
    # per GEMM the two differ by FP32 rounding at most (torch's CPU kernel happens to
    # match bit for bit): the same training, to that rounding compounded over 20 steps
    assert real == pytest.approx(emulated, rel=1e-4)
