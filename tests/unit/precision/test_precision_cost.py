"""The cost model against a hand-computed example."""

import pytest

from megatron_ext.precision.cost import (ModelShape, flop_report, gemm_class, site_cost,
                                        stage_fixed_seconds, stage_seconds)
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats

# 2 layers, hidden 4, ffn 6 (SwiGLU), 2 heads of dim 2, 1 KV group, 10 tokens, PP = 2.
# (N, K): qkv (2*2 + 2*1*2, 4) = (8, 4) -> 32; proj (4, 4) -> 16; fc1 (12, 4) -> 48;
# fc2 (4, 6) -> 24. One GEMM costs 2*T*N*K = 20*N*K; a layer 3 * 20 * 120 = 7200.
SHAPE = ModelShape(num_layers=2, hidden_size=4, ffn_hidden_size=6, num_attention_heads=2,
                   num_query_groups=1, swiglu=True, tokens=10, pipeline_stages=2)

PLAN = PrecisionPlan({
    # fprop fp4 (640); dgrad and wgrad read the fp8 dy: fp8 (2 * 640)
    "L0.qkv": SiteFormats("fp4_e2m1@tile128", "fp4_e2m1@block128", "fp8_e4m3@tile128"),
    "L0.fc1": UNIFORM["fp4"],  # 3 * 20 * 48 = 2880 fp4; L0.proj, L0.fc2 unlisted: 2400 bf16
    **{f"L1.{s}": UNIFORM["fp8"] for s in ("qkv", "proj", "fc1")},  # 3 * 20 * 96 = 5760 fp8
    # fc2: fprop and dgrad fp8 (2 * 480), wgrad reads a bf16 x: bf16 (480)
    "L1.fc2": SiteFormats(*(UNIFORM["fp8"].x, UNIFORM["fp8"].w, UNIFORM["fp8"].dy),
                          overrides=(("wgrad.x", "bf16"),)),
})


def test_hand_computed_example():
    assert ([SHAPE.site_nk(s) for s in ("qkv", "proj", "fc1", "fc2")] ==
            [(8, 4), (4, 4), (12, 4), (4, 6)])
    report = flop_report(PLAN.formats, SHAPE)
    assert report.total == 14400
    stage0 = {"fp4": 640 + 2880, "fp8": 1280, "bf16": 2400}
    stage1 = {"fp4": 0, "fp8": 5760 + 960, "bf16": 480}
    assert report.stage_fractions == [
        pytest.approx({c: v / 7200 for c, v in stage0.items()}),
        pytest.approx({c: v / 7200 for c, v in stage1.items()})]
    overall = {c: (stage0[c] + stage1[c]) / 14400 for c in stage0}
    assert report.fractions == pytest.approx(overall)
    assert report.time_vs_bf16 == pytest.approx(
        overall["bf16"] + overall["fp8"] / 2 + overall["fp4"] / 4)
    metrics = report.metrics()
    assert metrics["fp4_flop_frac"] == pytest.approx(3520 / 14400)
    assert metrics["fp4_flop_frac_stage0"] == pytest.approx(3520 / 7200)
    assert metrics["bf16_flop_frac_stage1"] == pytest.approx(480 / 7200)


def test_a_gemm_runs_at_its_wider_operand():
    assert gemm_class("fp4_e2m1@tile128", "mxfp8") == "fp8"
    assert gemm_class("nvfp4", "none") == "bf16"
    assert gemm_class("mxfp4", "int4@tile128") == "fp4"
    assert gemm_class("fp6_e2m3@tile128", "fp4_e2m1") == "fp8"
    assert gemm_class("bf16", "fp8_e4m3") == "bf16"


def test_pipeline_stages_follow_megatrons_layout():
    plain = ModelShape(8, 4, 6, 2, 1, True, 10, pipeline_stages=2)
    assert [plain.stage_of(i) for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    interleaved = ModelShape(8, 4, 6, 2, 1, True, 10, pipeline_stages=2,
                             layers_per_virtual_stage=2)
    assert [interleaved.stage_of(i) for i in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_single_stage_metrics_have_no_stage_keys():
    report = flop_report(lambda sid: UNIFORM["fp8"], ModelShape(2, 4, 6, 2, 1, False, 10))
    assert report.metrics() == {"fp4_flop_frac": 0.0, "fp8_flop_frac": 1.0,
                                "bf16_flop_frac": 0.0, "gemm_time_vs_bf16": 0.5}


def test_site_times_follow_the_wider_operand():
    """L0.qkv of PLAN: fprop FP4, dgrad and wgrad FP8; each GEMM 2*10*8*4 = 640 FLOPs."""
    cost = site_cost(SHAPE, "qkv", PLAN.formats("L0.qkv"), bf16_flops_per_s=100.0)
    assert cost.classes == ("fp4", "fp8", "fp8")
    assert (cost.gemm_flops, cost.flops, cost.fp4_flops) == (640, 1920, 640)
    assert cost.seconds == pytest.approx(640 / 400 + 2 * 640 / 200)
    bf16 = site_cost(SHAPE, "fc2", SiteFormats(), bf16_flops_per_s=100.0)  # (4, 6): 480
    assert bf16.classes == ("bf16",) * 3 and bf16.seconds == pytest.approx(3 * 480 / 100)


def test_fixed_time_is_attention_core_per_layer_and_output_layer_on_the_last_stage():
    # 6*T*s*h = 6*10*5*4 = 1200 per layer; 6*T*v*h = 6*10*7*4 = 1680 on the last stage
    shape = ModelShape(3, 4, 6, 2, 1, True, 10, pipeline_stages=2, seq_length=5, vocab_size=7)
    assert (stage_fixed_seconds(shape, 10.0, stage_of=[0, 0, 1]) ==
            pytest.approx([2 * 120, 120 + 168]))
    plain = ModelShape(2, 4, 6, 2, 1, True, 10, pipeline_stages=2, seq_length=5)
    assert stage_fixed_seconds(plain, 10.0) == pytest.approx([120, 120])  # no vocab: no output
    with pytest.raises(ValueError, match="stage_of must give a stage"):
        stage_fixed_seconds(shape, 10.0, stage_of=[0, 2, 1])


def test_stage_seconds_add_gemm_and_fixed_times():
    shape = ModelShape(2, 4, 6, 2, 1, True, 10, pipeline_stages=2, seq_length=5, vocab_size=7)
    # stage 0 (L0): fp4 3520, fp8 1280, bf16 2400 FLOPs; stage 1 (L1): fp8 6720, bf16 480
    gemm = [3520 / 4 + 1280 / 2 + 2400, 6720 / 2 + 480]
    fixed = [1200, 1200 + 1680]
    assert (stage_seconds(PLAN.formats, shape, 1.0) ==
            pytest.approx([g + f for g, f in zip(gemm, fixed)]))
    report = flop_report(PLAN.formats, shape)
    assert report.stage_flops == [7200, 7200]
    swapped = flop_report(PLAN.formats, shape, stage_of=[1, 0])  # an explicit split
    assert swapped.stage_fractions[1]["fp4"] == pytest.approx(3520 / 7200)


def test_gemm_intensity_and_ridge_points_by_hand():
    from megatron_ext.precision.cost import DEVICES, gemm_intensity

    # (128 x 128) @ (128 x 256): 2·128·256·128 = 8388608 FLOPs over 2·(128·128 + 128·256 +
    # 128·256) = 163840 bytes
    assert gemm_intensity(128, 256, 128) == pytest.approx(51.2)
    assert gemm_intensity(4096, 4096, 4096) == pytest.approx(4096 / 3)  # n³ / 3n² (BF16)
    assert gemm_intensity(8, 8, 8, bytes_per_element=1) == pytest.approx(16 / 3)
    ridges = {name: round(d.ridge) for name, d in DEVICES.items()}
    assert ridges == {"h100": 295, "h200": 206, "b200": 281, "a100": 153, "cpu": 7}
