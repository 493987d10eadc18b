"""The dry-run seam: extensions' parts (columns, lines, memory, times, JSON) and the two parts
of the defaults — the precision platform's stage times, checked against the closed form of
the cost model evaluated by hand, and SNIP's ILP plan standing in for its policies."""

import argparse
import json

import pytest

from megatron_ext.defaults import default_extensions
from megatron_ext.extension import DryRunPart, Extension, StageTimes
from megatron_ext.precision.extension import precision_extension
from megatron_ext.training.dry_run import estimates as est
from megatron_ext.training.dry_run.meta import StageParams
from megatron_ext.training.dry_run.parts import DryRunContext, collect
from megatron_ext.training.pretrain import pretrain

# tiny llama: h 128, SwiGLU ffn 352, 4 heads of 32, 2 KV groups, 4 layers
TINY = ["--mock-data", "--vocab-size", "4096", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2"]
SUM_NK = 256 * 128 + 128 * 128 + 704 * 128 + 128 * 352  # qkv, proj, fc1, fc2


def dry(argv, extensions, tmp_path=None):
    json_flag = ["--dry-run-json", str(tmp_path / "r.json")] if tmp_path else []
    return pretrain("llama", [*argv, "--dry-run", *json_flag], extensions)


def test_precision_times_are_the_cost_model_by_hand(tmp_path, capsys):
    report = dry([*TINY, "--precision", "uniform:fp8", "--dry-run-bf16-tflops", "100"],
                 [precision_extension()], tmp_path)
    T, s, h, v, rate, tp = 2 * 64, 64, 128, 4096, 100e12, 2
    per_layer = 3 * 2 * T * SUM_NK / 2 + 6 * T * s * h  # every GEMM FP8; attention core BF16
    expected = [2 * per_layer / (tp * rate), (2 * per_layer + 6 * T * v * h) / (tp * rate)]
    assert [st.seconds for st in report.stages] == pytest.approx(expected, rel=1e-12)
    assert report.step_seconds == pytest.approx((4 + 2 - 1) * expected[1], rel=1e-12)
    assert report.tokens_per_second == pytest.approx(8 * 64 / report.step_seconds)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["stages"][1]["linear_flops"] == pytest.approx(2 * 6 * 8 * 64 * SUM_NK)
    assert saved["stages"][1]["sites"] == 8 and saved["plan"] == "uniform:fp8"
    assert "time (plan uniform:fp8)" in capsys.readouterr().out


def test_precision_memory_is_the_kept_weight_copies_by_hand(capsys):
    """uniform:fp8 emulated keeps fprop's 128x128-block q(w) for dgrad: a BF16 copy of each
    GPU's weight shard (2 bytes x SUM_NK / TP per layer, 2 layers a stage), once per step with
    the weight cache; without it, once per micro-batch the stage holds (stage 0 of PP 2
    holds 2 of the 4, stage 1 one). The bytes are each stage's extra memory and JSON entry."""
    copy = 2 * 2 * SUM_NK / 2
    flags = [*TINY, "--precision", "uniform:fp8", "--fp8-execution", "emulated"]
    for extra, want in (([], [copy, copy]), (["--no-cache-quantized-weights"], [2 * copy, copy])):
        report = dry([*flags, *extra], [precision_extension()])
        assert [st.memory.extra for st in report.stages] == want
        assert ([s["quantized_gemm_kept_bytes"] for s in report.parts["precision"].stage_json]
                == want)
    assert "the quantized GEMMs keep +0.00 GiB on stage 0" in capsys.readouterr().out
    # blockwise FP8 runs real only for reductions of a multiple of 512 (real_gemm): at K = 128
    # fprop stays emulated and keeps q(w) as above, real execution asked for or not
    report = dry([*flags[:-1], "real"], [precision_extension()])
    assert [st.memory.extra for st in report.stages] == [copy, copy]


def test_without_a_precision_extension_there_is_no_time_estimate(capsys):
    report = dry(TINY, [])
    assert report.step_seconds is None and report.times is None and report.parts == {}
    assert all(st.seconds is None for st in report.stages)
    out = capsys.readouterr().out
    assert "time: no estimate" in out and "t/mb" not in out and "SNIP" not in out
    assert json.loads(report.to_json())["tokens_per_second"] is None


def _fp4(report) -> list[float]:
    return [s["fp4_fraction"] for s in report.parts["precision"].stage_json]


def test_snip_plan_stands_in_and_the_keep_overlay_lies_over_it():
    snip = dry([*TINY, "--precision", "snip", "--snip-budget", "0.5"], default_extensions())
    assert snip.parts["precision"].json["plan"] == "snip (dry run, synthetic statistics)"
    # the cost model's FP4 share of the stand-in plan is the ILP's own accounting
    assert _fp4(snip) == pytest.approx(snip.parts["snip"].json["ilp"]["stage_fp4_fraction"])
    assert min(_fp4(snip)) >= 0.25 - 1e-9  # eq. 5: every stage >= budget / stages
    kept = dry([*TINY, "--precision", "snip", "--keep-first-last-layers-bf16", "2"],
               default_extensions())  # keeps all 4 layers in BF16
    assert kept.parts["precision"].json["plan"].endswith("+keep2bf16") and _fp4(kept) == [0, 0]
    bf16 = dry(TINY, default_extensions())
    assert [s.seconds for s in kept.stages] == pytest.approx([s.seconds for s in bf16.stages])
    baseline = dry([*TINY, "--precision", "min-rel-err", "--snip-budget", "0.3"],
                   default_extensions())
    assert (baseline.parts["precision"].json["plan"] ==
            "min-rel-err: stood in for by the SNIP ILP plan at budget 0.3")
    assert min(_fp4(baseline)) >= 0.15 - 1e-9


def _toy(seen: list):
    def estimate(args, context):
        seen.append(context)
        return DryRunPart(columns=("toy",), cells=tuple((f"t{s.stage}",) for s in context.stages),
                          memory=tuple(2.0**30 * (1 + s.stage) for s in context.stages),
                          lines=("toy: a summary line",), notes=("toy assumption",),
                          stage_json=tuple({"toy_layers": len(s.layers)} for s in context.stages),
                          json={"toy": {"vocab": context.vocab}})
    return Extension(name="toy", dry_run_estimate=estimate)


def test_a_part_adds_columns_lines_memory_and_json(tmp_path, capsys):
    seen = []
    argv = ["--mock-data", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
            "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "16"]
    report = dry(argv, [_toy(seen)], tmp_path)
    (context,) = seen
    assert context.layer_stages == [0, 0, 1, 1, 0, 0, 1, 1]
    for st in report.stages:
        m = st.memory
        assert m.extra == 2.0**30 * (1 + st.params.stage)
        assert m.total == m.weights + m.grads + m.optimizer + m.activations + m.extra
    out = capsys.readouterr().out
    header = out.splitlines()[1].split()
    assert header[4] == "toy" and "extra" in header and "t/mb" not in header
    assert "toy: a summary line" in out and "note: toy assumption" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["toy"] == {"vocab": context.vocab} and saved["stages"][0]["toy_layers"] == 4
    assert saved["stages"][1]["memory"]["extra"] == 2.0**31


def _context(stages: int = 2) -> DryRunContext:
    layout = est.Layout(1, stages, 1, 1, 4, 1, 16, False, True, False, False, False)
    params = tuple(StageParams(k, (k,), 10, 10, 0, k == 0, k == stages - 1)
                   for k in range(stages))
    return DryRunContext(layout, params, 256, 1e12)


@pytest.mark.parametrize("parts, message", [
    ([DryRunPart(columns=("a",), cells=(("x",),))], "cells has 1 entries for 2 stages"),
    ([DryRunPart(columns=("a",), cells=(("x",), ("y", "z")))], "do not match its 1 columns"),
    ([DryRunPart(memory=(1.0,))], "memory has 1 entries"),
    ([DryRunPart(times=StageTimes((1.0, 2.0), "b", "h"))] * 2, "several extensions estimate"),
    ([DryRunPart(moments=(1.0,))], "moments has 1 entries"),
    ([DryRunPart(moments=(1.0, 2.0))] * 2, "several extensions estimate optimizer moments"),
    ([DryRunPart(json={"x": 1}), DryRunPart(json={"x": 2})], "JSON key twice"),
    ([DryRunPart(json={"stages": 1})], "JSON key twice"),
])
def test_malformed_parts_are_refused(parts, message):
    extensions = [Extension(name=f"e{i}", dry_run_estimate=lambda a, c, p=p: p)
                  for i, p in enumerate(parts)]
    with pytest.raises(ValueError, match=message):
        collect(extensions, argparse.Namespace(), _context(), ("stages",))
