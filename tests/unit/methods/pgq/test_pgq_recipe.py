"""PGQ recipes on the hand-made profile of ``pgq_synthetic.py``: decisions, roofline, budget
bisection, adversarial and random recipes, the plan's per-GEMM formats, the report, the
profile's JSON and the tool's command line — every expected value worked out by hand there."""

import json
import math
import sys
from pathlib import Path

import pytest

from megatron_ext.methods.pgq import cli
from megatron_ext.methods.pgq.profile import Profile, load_profile
from megatron_ext.methods.pgq.recipe import RecipeConfig, make_recipe
from megatron_ext.methods.pgq.report import recipe_json, recipe_markdown
from megatron_ext.methods.pgq.sqnr import CANDIDATES
from megatron_ext.precision.cost import site_cost
from megatron_ext.precision.plan import load_plan
from megatron_ext.precision.site_formats import SiteFormats, resolve
from megatron_ext.sites import GEMM_ROLES

sys.path.insert(0, str(Path(__file__).parent))
from pgq_synthetic import GEMM_FLOPS, SHAPE, TOTAL, synthetic_profile  # noqa: E402

PROFILE = synthetic_profile()
NO_ROOF = RecipeConfig(device="none")
INT8 = CANDIDATES["int8"]


def _quantized(recipe) -> set[str]:
    return {d.name for d in recipe.decisions if d.quantized}


def _flops(names) -> int:
    return sum(GEMM_FLOPS[n.split(".")[1]] for n in names)


def test_cost_model_flops_are_the_hand_values():
    assert {s: site_cost(SHAPE, s, SiteFormats()).gemm_flops for s in GEMM_FLOPS} == GEMM_FLOPS


def test_thresholds_quantize_the_gemms_with_margin_at_least_one():
    recipe = make_recipe(PROFILE, NO_ROOF)
    expected = {"L0.qkv.fprop", "L0.qkv.wgrad", "L0.proj.dgrad", "L0.proj.wgrad",
                "L0.fc1.fprop", "L0.fc1.dgrad", "L0.fc2.fprop", "L0.fc2.dgrad",
                "L0.fc2.wgrad"}  # margin 1 exactly (fc2.wgrad) passes
    assert _quantized(recipe) == expected and recipe.scale == 1.0
    assert recipe.fraction == pytest.approx(5280 / TOTAL)  # cost model == hand sum
    assert recipe.time_vs_bf16 == pytest.approx(1 - recipe.fraction / 2)  # int8: FP8 rate
    rows = {d.name: d for d in recipe.decisions}
    assert rows["L0.proj.fprop"].worst == "w" and rows["L0.proj.fprop"].min_sqnr == 10
    assert rows["L0.proj.fprop"].reason.startswith("kept: min SQNR 10 (10.0 dB) of w < 20")
    assert rows["L0.fc2.wgrad"].reason.startswith("quantized: min SQNR 1 (0.0 dB) of dy >= 1")
    # embedding / logits: reported with what the threshold says, never quantized
    assert not rows["logits.dgrad"].quantized and not rows["logits.dgrad"].linear
    assert "output layer: not in a plan" in rows["logits.dgrad"].reason
    assert "< 1" in rows["logits.dgrad"].reason and "< 20" in rows["embedding.fprop"].reason


def test_plan_runs_exactly_the_quantized_gemms():
    recipe = make_recipe(PROFILE, NO_ROOF)
    plan = recipe.plan
    assert plan.method == "pgq" and plan.budget is None
    assert plan.sites["L0.fc2"] == INT8  # all three GEMMs: the candidate, no override
    assert plan.sites["L0.qkv"] == SiteFormats(  # fprop, wgrad: x both; w, dy one each
        INT8.x, "none", "none", overrides=(("fprop.w", INT8.w), ("wgrad.dy", INT8.dy)))
    assert plan.sites["L0.proj"] == SiteFormats(  # dgrad, wgrad
        "none", "none", INT8.dy, overrides=(("dgrad.w", INT8.w), ("wgrad.x", INT8.x)))
    quantized = _quantized(recipe)
    for site in ("L0.qkv", "L0.proj", "L0.fc1", "L0.fc2"):
        ops = resolve(plan.formats(site))
        for gemm, roles in GEMM_ROLES.items():
            formats = [getattr(ops, f"{gemm}_{role}") for role in roles]
            on = f"{site}.{gemm}" in quantized
            assert all((f is not None) == on for f in formats), (site, gemm)


def test_roofline_keeps_memory_bound_gemms():
    recipe = make_recipe(PROFILE, RecipeConfig(device="h100"))  # ridge 295: qkv, fc1 only
    assert _quantized(recipe) == {"L0.qkv.fprop", "L0.qkv.wgrad", "L0.fc1.fprop",
                                  "L0.fc1.dgrad"}
    assert recipe.fraction == pytest.approx(3200 / TOTAL)
    proj = next(d for d in recipe.decisions if d.name == "L0.proj.dgrad")
    assert not proj.eligible and proj.reason == "memory-bound: intensity 100 < ridge 295 FLOP/B"


@pytest.mark.parametrize("budget, scale, fraction", [
    (0.5, 2.0, 4320 / TOTAL),   # margins >= 2: 500, 20, 5, 4, 3, 2, 2
    (0.3, 4.0, 2400 / TOTAL),   # margins >= 4
    (0.9, 0.5, 1.0),            # everything
    (5280 / TOTAL, 1.0, 5280 / TOTAL),  # exactly the unscaled recipe
    (0.0, math.inf, 0.0),       # nothing
])
def test_budget_bisection_scales_both_thresholds(budget, scale, fraction):
    recipe = make_recipe(PROFILE, RecipeConfig(device="none", budget=budget))
    assert recipe.scale == scale and recipe.fraction == pytest.approx(fraction)
    assert recipe.plan.budget == budget and recipe.target == budget
    fprop = next(d for d in recipe.decisions if d.name == "L0.qkv.fprop")
    assert fprop.threshold == 20 * scale
    assert all((d.min_sqnr >= d.threshold) == d.quantized for d in recipe.decisions if d.linear)


def test_budget_out_of_reach_quantizes_every_eligible_gemm():
    recipe = make_recipe(PROFILE, RecipeConfig(device="h100", budget=0.9))
    assert _quantized(recipe) == {f"L0.{s}.{g}" for s in ("qkv", "fc1") for g in GEMM_ROLES}
    assert recipe.fraction == pytest.approx(4800 / TOTAL) and recipe.target == 0.9
    assert "budget 0.9 out of reach" in recipe_markdown(recipe)


def test_adversarial_takes_the_lowest_margins_at_the_recipe_fraction():
    recipe = make_recipe(PROFILE, RecipeConfig(device="none", mode="adversarial"))
    # ascending margins: proj.fprop .5, qkv.dgrad .5, fc1.wgrad .8, fc2.wgrad 1, fc2.dgrad
    # 1.5, fc1.fprop 2, qkv.wgrad 2, proj.wgrad 3 -> 4800 FLOPs; one more (fc1.dgrad) 5760:
    # both 480 from the recipe's 5280, the tie goes to the shorter prefix
    assert _quantized(recipe) == {"L0.proj.fprop", "L0.qkv.dgrad", "L0.fc1.wgrad",
                                  "L0.fc2.wgrad", "L0.fc2.dgrad", "L0.fc1.fprop",
                                  "L0.qkv.wgrad", "L0.proj.wgrad"}
    assert recipe.target == pytest.approx(5280 / TOTAL)
    assert recipe.fraction == pytest.approx(4800 / TOTAL)
    assert recipe.plan.method == "pgq:adversarial"
    assert all(d.reason.startswith("adversarial (lowest margins first)")
               for d in recipe.decisions if d.linear)


def test_random_recipe_is_seeded_and_matches_the_fraction():
    plans = {}
    for seed in range(6):
        recipe = make_recipe(PROFILE, RecipeConfig(device="h100", mode="random", seed=seed))
        chosen = _quantized(recipe)
        assert chosen <= {d.name for d in recipe.decisions if d.eligible}
        # prefixes grow by at most one GEMM (960 FLOPs): the closest is within half of it
        assert abs(_flops(chosen) - 3200) <= 480 and recipe.target == pytest.approx(3200 / TOTAL)
        plans[seed] = chosen
    assert len({frozenset(p) for p in plans.values()}) > 1  # seeds differ
    again = make_recipe(PROFILE, RecipeConfig(device="h100", mode="random", seed=3))
    assert _quantized(again) == plans[3]


def test_unknown_format_is_a_value_error():
    with pytest.raises(ValueError, match="format 'fp8' was not profiled"):
        make_recipe(PROFILE, RecipeConfig(format="fp8"))


def test_report_lists_every_gemm_and_writes_no_infinity():
    recipe = make_recipe(PROFILE, RecipeConfig(device="none", budget=0.0))
    markdown = recipe_markdown(recipe)
    assert sum(line.startswith("| L0.") for line in markdown.splitlines()) == 12
    assert "| logits.fprop | for | inf (exact) |" in markdown
    data = json.loads(json.dumps(recipe_json(recipe), allow_nan=False))
    assert len(data["gemms"]) == 17 and data["scale"] is None
    assert data["thresholds"] == {"forward": None, "backward": None}
    logits = next(g for g in data["gemms"] if g["name"] == "logits.fprop")
    assert logits["min_sqnr"] is None and data["plan_hash"] == recipe.plan.hash


def test_profile_json_round_trip(tmp_path):
    text = json.dumps(PROFILE.to_dict(), allow_nan=False)
    assert Profile.from_dict(json.loads(text)) == PROFILE
    path = tmp_path / "p.json"
    path.write_text('{"version": 1, "kind": "pgq-profile", "gemms": [{}]}')
    with pytest.raises(ValueError, match="p.json': malformed PGQ profile"):
        load_profile(str(path))


def _write_profile(tmp_path) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE.to_dict(), allow_nan=False))
    return str(path)


def test_tool_writes_recipe_and_plan(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main([_write_profile(tmp_path), "--out", str(out), "--pgq-device", "none",
                     "--pgq-budget", "0.5"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "recipe.json", "recipe.md"]
    expected = make_recipe(PROFILE, RecipeConfig(device="none", budget=0.5))
    assert load_plan(str(out / "plan.json")) == expected.plan
    assert json.loads((out / "recipe.json").read_text())["fraction"] == expected.fraction
    assert capsys.readouterr().out.strip().endswith("est. GEMM time 0.70x BF16")


@pytest.mark.parametrize("flags, message", [
    (["--pgq-format", "fp4"], "format 'fp4' was not profiled"),
    (["--pgq-budget", "2"], "--pgq-budget must be in [0, 1]"),
    (["--pgq-fwd-threshold", "0"], "--pgq-fwd-threshold must be a positive"),
    (["--pgq-adversarial", "--pgq-random"], "exclude each other"),
    (["--pgq-device", "tpu"], "invalid choice: 'tpu'"),
])
def test_tool_bad_input_is_one_line(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert cli.main([_write_profile(tmp_path), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and not out.exists()


def test_tool_missing_profile_is_one_line(tmp_path, capsys):
    assert cli.main([str(tmp_path / "nope.json"), "--out", str(tmp_path / "o")]) == 2
    assert (capsys.readouterr().err.strip() ==
            f"error: cannot read '{tmp_path / 'nope.json'}': No such file or directory")
