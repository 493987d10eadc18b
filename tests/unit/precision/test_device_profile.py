"""The device-aware cost model: profiles and their JSON, the emulated-format rule, a measured
profile from a GEMM table, the step estimate's parts, and SNIP's time-mode plan per device."""

import dataclasses
import itertools
import json
import re

import pytest

from megatron_ext.errors import UsageError
from megatron_ext.formats import available, get_format
from megatron_ext.methods.snip.ilp import solve
from megatron_ext.methods.snip.planner import build_problem
from megatron_ext.precision.cost import ModelShape, flop_report, site_cost, stage_fixed_seconds
from megatron_ext.precision.device_profile import PROFILES, DeviceProfile, infer, resolve
from megatron_ext.precision.extension import _summary
from megatron_ext.precision.measured_profile import measurement_base, profile_from_gemm
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.precision.step_estimate import calibrate, step_estimate
from megatron_ext.sites import SITES, all_site_ids

SHAPE = ModelShape(num_layers=2, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
                   num_query_groups=16, swiglu=False, tokens=8192)
"""TinyLlama's widths, 2 layers, 8192 tokens: wide enough that B200's FP4 beats its FP8
with the quantization of the operands counted."""
FP8 = SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e5m2")
FP4 = SiteFormats("mxfp4", "mxfp4", "mxfp4")
BF16 = SiteFormats()


def _json(tmp_path, profile: DeviceProfile, name: str) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(profile.to_json())
    return str(path)


def _uniform(formats: SiteFormats, layers: int = SHAPE.num_layers) -> PrecisionPlan:
    return PrecisionPlan({s: formats for s in all_site_ids(layers)}, method="uniform")


def _estimate(line: str) -> float:
    return float(re.search(r"est\. GEMM time ([0-9.]+)x BF16", line).group(1))


# ---------------------------------------------------------------- profiles and JSON


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_json_round_trip_of_every_built_in(tmp_path, name):
    assert resolve(_json(tmp_path, PROFILES[name], name)) == PROFILES[name]
    assert resolve(name) is PROFILES[name]


@pytest.mark.parametrize("edit, message", [
    (lambda d: "not json", "not JSON"),
    (lambda d: {**d, "version": 2}, "version 1"),
    (lambda d: {k: v for k, v in d.items() if k != "native"}, "fields must be"),
    (lambda d: {**d, "speed": 1}, "fields must be"),
    (lambda d: {**d, "native": {"fp8_e4m3": -2}}, "native rate of 'fp8_e4m3'"),
    (lambda d: {**d, "native": {"fp9": 2}}, "native bad format name 'fp9'"),
    (lambda d: {**d, "native": {"class:fp6": 2}}, "class:fp4 or class:fp8"),
    (lambda d: {**d, "bf16_flops_per_s": 0}, "bf16_flops_per_s must be a positive"),
    (lambda d: {**d, "emulate_s_per_element": "1e-12"}, "emulate_s_per_element"),
])
def test_a_bad_profile_file_is_one_usage_error_line(tmp_path, edit, message):
    data = edit(json.loads(PROFILES["h100"].to_json()))
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(UsageError, match=re.escape(message)) as err:
        resolve(str(path))
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_a_missing_file_names_the_choices():
    with pytest.raises(UsageError, match="not one of auto, nominal, cpu, h100"):
        resolve("/nonexistent/profile.json")


def test_auto_is_the_gpu_by_name_else_nominal():
    assert infer("NVIDIA H100 80GB HBM3") is PROFILES["h100"]
    assert infer("NVIDIA H200") is PROFILES["h200"]
    assert infer("NVIDIA B200") is PROFILES["b200"]
    assert infer("NVIDIA A100-SXM4-80GB") is PROFILES["nominal"] is infer(None)
    assert resolve("auto") is PROFILES["nominal"]  # no GPU here


def test_which_formats_are_native_where():
    h100, b200 = PROFILES["h100"], PROFILES["b200"]
    for name in ("fp8_e4m3", "fp8_e5m2@row", "fp8_e4m3@tile128", "fp8_e4m3@block128+sr"):
        assert h100.rate(name) == 2.0 == b200.rate(name)
    for name in ("mxfp4", "nvfp4", "int8", "mxfp8", "fp4_e2m1@tile128", "int4@row"):
        assert h100.rate(name) is None
    assert b200.rate("mxfp4") == b200.rate("nvfp4") == 4.0 and b200.rate("mxfp8") == 2.0
    assert all(PROFILES["cpu"].rate(n) is None for n in available())
    assert PROFILES["nominal"].rate("int4@row") == 4.0 and PROFILES["nominal"].rate("int8") == 2


# ---------------------------------------------------------------- the cost of a GEMM


def test_site_cost_by_hand_native_and_emulated():
    n, k = SHAPE.site_nk("fc1")
    t, g = SHAPE.tokens, 2.0 * SHAPE.tokens * n * k
    elements = 2 * (t * k + n * k + t * n)  # each operand of each of the three GEMMs
    for profile in (PROFILES["h100"], PROFILES["b200"]):
        r, qs, es = (profile.bf16_flops_per_s, profile.quantize_s_per_element,
                     profile.emulate_s_per_element)
        assert site_cost(SHAPE, "fc1", BF16, profile=profile).seconds == pytest.approx(3 * g / r)
        fp8 = site_cost(SHAPE, "fc1", FP8, profile=profile)
        assert fp8.seconds == pytest.approx(3 * g / (2 * r) + qs * elements)
        assert fp8.quantize_seconds == pytest.approx(qs * elements)
    h100, b200 = PROFILES["h100"], PROFILES["b200"]
    assert site_cost(SHAPE, "fc1", FP4, profile=h100).seconds == pytest.approx(
        3 * g / h100.bf16_flops_per_s + h100.emulate_s_per_element * elements)
    assert site_cost(SHAPE, "fc1", FP4, profile=b200).seconds == pytest.approx(
        3 * g / (4 * b200.bf16_flops_per_s) + b200.quantize_s_per_element * elements)
    mixed = SiteFormats("fp8_e4m3", "mxfp4", "none")  # fprop fp8 x mxfp4, dgrad bf16 x mxfp4
    assert site_cost(SHAPE, "fc1", mixed, profile=b200).seconds == pytest.approx(
        g / (2 * b200.bf16_flops_per_s) + 2 * g / b200.bf16_flops_per_s
        + b200.quantize_s_per_element * (t * k + n * k)
        + b200.emulate_s_per_element * (n * k + t * k))


def test_nominal_keeps_the_papers_numbers():
    plan = PrecisionPlan({"L0.qkv": FP4, "L0.fc1": FP8, "L1.fc2": FP4}, method="m")
    report = flop_report(plan.formats, SHAPE)
    expected = sum(report.fractions[c] / s for c, s in (("bf16", 1), ("fp8", 2), ("fp4", 4)))
    assert report.time_vs_bf16 == pytest.approx(expected, rel=1e-12)
    assert report.profile == "nominal"
    assert flop_report(_uniform(FP4).formats, SHAPE).time_vs_bf16 == 0.25


def _emulated_fp4_profiles(tmp_path):
    measured = profile_from_gemm(_table(), measurement_base("NVIDIA H100"), "H100 measured")
    return [PROFILES["cpu"], PROFILES["h100"], PROFILES["h200"],
            resolve(_json(tmp_path, measured, "measured"))]


def test_an_emulated_format_is_never_faster_than_bf16(tmp_path):
    """Every uniform plan of a format the profile emulates (all FP4 formats on these) prints
    an estimate >= 1.00x BF16, and FP4 sites of a mixed (SNIP) plan never save time."""
    for profile in _emulated_fp4_profiles(tmp_path):
        for name in available():
            formats = SiteFormats(name, name, name)
            if get_format(name).bits > 8 or profile.rate(name) is not None:
                continue
            report = flop_report(_uniform(formats).formats, SHAPE, profile=profile)
            assert report.time_vs_bf16 >= 1.0 and _estimate(
                _summary(_uniform(formats).replace(stage_fp4_frac=[1.0]), report)) >= 1.0
        snip = _snip_plan(PROFILES["b200"])
        assert any(f == FP4 for f in snip.sites.values())
        without = PrecisionPlan({s: (BF16 if f == FP4 else f) for s, f in snip.sites.items()})
        assert (flop_report(snip.formats, SHAPE, profile=profile).time_vs_bf16
                >= flop_report(without.formats, SHAPE, profile=profile).time_vs_bf16)


def test_the_printed_estimate_follows_the_profile_file(tmp_path):
    plan = _uniform(FP4).replace(stage_fp4_frac=[1.0])
    nominal = _summary(plan, flop_report(plan.formats, SHAPE))
    h100 = resolve(_json(tmp_path, PROFILES["h100"], "h100"))
    on_h100 = _summary(plan, flop_report(plan.formats, SHAPE, profile=h100))
    assert _estimate(nominal) == 0.25 and nominal.endswith("(device nominal)")
    r, es = h100.bf16_flops_per_s, h100.emulate_s_per_element
    gemm = sum(3 * 2.0 * SHAPE.tokens * n * k for n, k in map(SHAPE.site_nk, SITES)) * 2
    quant = es * sum(2 * SHAPE.tokens * (n + k) + 2 * n * k
                     for n, k in map(SHAPE.site_nk, SITES)) * 2
    assert _estimate(on_h100) == pytest.approx(round(1 + quant * r / gemm, 2))
    assert on_h100.endswith("(device h100)")


# ---------------------------------------------------------------- a measured profile


def _table():
    """Fabricated gpu_check gemm measurements: BF16 at 500 TFLOP/s, per-tensor FP8 1.6x,
    blockwise 0.9x, 2 ps per element to quantize, 3 ps to fake-quantize."""
    rows = []
    for m, k, n in ((8192, 2048, 5632), (4096, 1024, 1024), (2048, 4096, 512)):
        bf16, elements = 2.0 * m * k * n / 500e12, m * k + k * n
        native = [{"a": a, "b": b, "gemm_s": bf16 / rate, "total_s": bf16 / rate
                   + 2e-12 * elements}
                  for a, b, rate in (("fp8_e4m3", "fp8_e4m3", 1.6),
                                     ("fp8_e4m3@tile128", "fp8_e4m3@block128", 0.9))]
        emulated = [{"a": "mxfp4", "b": "mxfp4", "total_s": bf16 + 3e-12 * elements}]
        rows.append({"m": m, "k": k, "n": n, "bf16_s": bf16, "native": native,
                     "emulated": emulated})
    return rows


def test_profile_from_a_measured_gemm_table(tmp_path):
    profile = profile_from_gemm(_table(), measurement_base("NVIDIA H100 80GB HBM3"), "H100 x")
    assert profile.bf16_flops_per_s == pytest.approx(500e12)
    assert profile.rate("fp8_e4m3") == pytest.approx(1.6)
    assert profile.rate("fp8_e5m2") == pytest.approx(1.6)  # same bits and scaling: same kernel
    assert profile.rate("fp8_e4m3@tile128") == pytest.approx(0.9)
    assert profile.rate("fp8_e5m2@block128") == pytest.approx(0.9)
    assert profile.rate("fp8_e4m3@row") == 2.0  # not measured: the H100 datasheet's
    assert profile.rate("mxfp4") is None
    assert profile.quantize_s_per_element == pytest.approx(2e-12)
    assert profile.emulate_s_per_element == pytest.approx(3e-12)
    assert profile.name == "H100 x" and profile.source.startswith("measured")
    assert resolve(_json(tmp_path, profile, "m")) == profile
    unknown = profile_from_gemm(_table(), measurement_base("Some GPU"), "x")
    assert unknown.rate("fp8_e4m3@row") is None
    assert unknown.rate("fp8_e4m3") == pytest.approx(1.6)
    with pytest.raises(ValueError, match="empty"):
        profile_from_gemm([], PROFILES["h100"], "x")
    with pytest.raises(ValueError, match="bf16_s must be a positive"):
        profile_from_gemm([{**_table()[0], "bf16_s": 0}], PROFILES["h100"], "x")


# ---------------------------------------------------------------- the step estimate


def test_step_estimate_parts_and_calibration():
    shape = dataclasses.replace(SHAPE, seq_length=64, vocab_size=512)
    h100 = calibrate(PROFILES["h100"], shape, 10e-3)
    bf16 = step_estimate(_uniform(BF16).formats, shape, h100)
    assert bf16.total_s == pytest.approx(10e-3) and bf16.quantize_s == 0
    assert bf16.fixed_s == pytest.approx(stage_fixed_seconds(shape, profile=PROFILES["h100"])[0])
    assert h100.nongemm_s_per_token_layer == pytest.approx(
        (10e-3 - bf16.gemm_s - bf16.fixed_s) / (shape.tokens * shape.num_layers))
    fp8 = step_estimate(_uniform(FP8).formats, shape, h100)
    elements = sum(2 * shape.tokens * (n + k) + 2 * n * k for n, k in map(shape.site_nk, SITES))
    assert fp8.gemm_s == pytest.approx(bf16.gemm_s / 2)
    assert fp8.quantize_s == pytest.approx(h100.quantize_s_per_element * elements * 2)
    assert (fp8.fixed_s, fp8.other_s) == (bf16.fixed_s, bf16.other_s)
    assert fp8.to_dict()["total_s"] == pytest.approx(fp8.total_s)


# ---------------------------------------------------------------- SNIP's time-mode plan


OPTIONS = [FP8, FP4, BF16]


def _q():
    """Quality loss per site x option: BF16 best, FP4 worst; distinct, so one optimum."""
    return [[1.0 + 0.01 * i, 3.0 + 0.1 * i, 0.0] for i in range(SHAPE.num_layers * len(SITES))]


def _problem(profile):
    import numpy as np

    return build_problem(all_site_ids(SHAPE.num_layers), OPTIONS, np.array(_q()), SHAPE, [0.0],
                         profile=profile)


def _snip_plan(profile, budget=0.5) -> PrecisionPlan:
    solution = solve(_problem(profile), budget, "time")
    by_name = {o.name: f for o, f in zip(_problem(profile).sites[0].options, OPTIONS)}
    return PrecisionPlan({s: by_name[c] for s, c in solution.choice.items()}, method="snip")


def _brute_force(profile, budget):
    """The least-Q choice by enumeration, times written out from the profile's fields (not the
    cost model), FP4 target ``budget``, time cap B of docs/snip.md."""
    r, qs, es = (profile.bf16_flops_per_s, profile.quantize_s_per_element,
                 profile.emulate_s_per_element)
    sites = [(layer, s) for layer in range(SHAPE.num_layers) for s in SITES]
    times, flops = [], []
    for _, s in sites:
        n, k = SHAPE.site_nk(s)
        t, g = SHAPE.tokens, 2.0 * SHAPE.tokens * n * k
        moved = 2 * (t * k + n * k + t * n)
        fp4 = (3 * g / (r * profile.rate("mxfp4")) + qs * moved if profile.rate("mxfp4")
               else 3 * g / r + es * moved)
        times.append([3 * g / (2 * r) + qs * moved, fp4, 3 * g / r])
        flops.append(3 * g)
    bound = sum(min(t[0], t[2]) - budget * (min(t[0], t[2]) - min(t)) for t in times)
    best = None
    for pick in itertools.product(range(3), repeat=len(sites)):
        fp4 = sum(f for f, j in zip(flops, pick) if j == 1) / sum(flops)
        time = sum(t[j] for t, j in zip(times, pick))
        q = sum(row[j] for row, j in zip(_q(), pick))
        if fp4 >= budget - 1e-12 and time <= bound * (1 + 1e-9) and (best is None
                                                                      or q < best[0]):
            best = (q, pick)
    return best[1]


def test_time_mode_plan_follows_the_profile_file(tmp_path):
    """From JSON files: FP4 native (b200) -> the plan takes FP4 for half the FLOPs; FP4
    emulated (h100) -> no FP4 at all, FP8 where the time cap needs it; both = brute force."""
    b200 = resolve(_json(tmp_path, PROFILES["b200"], "b200"))
    h100 = resolve(_json(tmp_path, PROFILES["h100"], "h100"))
    for profile, budget, target in ((b200, 0.5, 0.5), (h100, 0.5, 0.0)):
        problem = _problem(profile)
        assert problem.fp4_emulated == (profile is h100)
        solution = solve(problem, budget, "time")
        assert solution.status == "optimal" and solution.fp4_target == target
        names = [o.name for o in problem.sites[0].options]
        expected = _brute_force(profile, target)
        assert [names.index(solution.choice[s.site]) for s in problem.sites] == list(expected)
    assert 1 in _brute_force(b200, 0.5) and 1 not in _brute_force(h100, 0.0)
    # every site at its fastest on the H100: FP8 for qkv and the MLP; for proj (2048 x 2048)
    # quantizing each operand per GEMM costs more than FP8 saves, so BF16
    assert _brute_force(h100, 0.0) == (0, 2, 0, 0) * SHAPE.num_layers
