"""Direction-stratified recipes (``--pgq-forward``) and the logits GEMM as a quantizable site
(``--pgq-logits``) on the hand-made profile of ``pgq_synthetic.py``; every expected set worked
out by hand from its margins (forward: qkv 5, proj .5, fc1 2, fc2 20 — 2400 FLOPs; backward
4800 FLOPs; logits fprop inf, dgrad .08, wgrad .3, 2·10·8·4 = 640 FLOPs each)."""

import sys
from pathlib import Path

import pytest

from megatron_ext.methods.pgq.recipe import RecipeConfig, make_recipe
from megatron_ext.methods.pgq.report import summary
from megatron_ext.methods.pgq.sqnr import CANDIDATES
from megatron_ext.precision.site_formats import SiteFormats, resolve

sys.path.insert(0, str(Path(__file__).parent))
from pgq_synthetic import TOTAL, synthetic_profile  # noqa: E402

PROFILE = synthetic_profile()
INT8 = CANDIDATES["int8"]
FORWARD = {f"L0.{s}.fprop" for s in ("qkv", "proj", "fc1", "fc2")}


def _quantized(recipe) -> set[str]:
    return {d.name for d in recipe.decisions if d.quantized}


def test_forward_all_budget_bisects_over_backward_only():
    # 0.5 of 7200 = 3600; forward fixed 2400, so 1200 more from the backward margins
    # descending: proj.dgrad 500 (320), fc1.dgrad 4 (960) -> 1280 at scale 4
    recipe = make_recipe(PROFILE, RecipeConfig(device="none", budget=0.5, forward="all"))
    assert _quantized(recipe) == FORWARD | {"L0.proj.dgrad", "L0.fc1.dgrad"}
    assert recipe.scale == 4.0 and recipe.fraction == pytest.approx(3680 / TOTAL)
    row = next(d for d in recipe.decisions if d.name == "L0.proj.fprop")  # margin .5: kept
    assert row.quantized and row.reason == "forward quantized (--pgq-forward all)"
    assert "4 fwd / 2 bwd" in summary(recipe)


def test_forward_all_adversarial_reverses_only_the_backward_decision():
    # the recipe's backward 1280 FLOPs; ascending backward margins: qkv.dgrad .5 (640),
    # fc1.wgrad .8 (960): prefixes 640 / 1600, the second is closer (320 vs 640)
    recipe = make_recipe(PROFILE, RecipeConfig(device="none", budget=0.5, forward="all",
                                               mode="adversarial"))
    assert _quantized(recipe) == FORWARD | {"L0.qkv.dgrad", "L0.fc1.wgrad"}
    assert recipe.target == pytest.approx(3680 / TOTAL)
    assert recipe.fraction == pytest.approx(4000 / TOTAL)


def test_forward_all_random_keeps_every_forward_gemm():
    chosen = set()
    for seed in range(6):
        recipe = make_recipe(PROFILE, RecipeConfig(device="none", budget=0.5, forward="all",
                                                   mode="random", seed=seed))
        backward = _quantized(recipe) - FORWARD
        assert FORWARD <= _quantized(recipe) and all("fprop" not in n for n in backward)
        flops = {"qkv": 640, "proj": 320, "fc1": 960, "fc2": 480}
        assert abs(sum(flops[n.split(".")[1]] for n in backward) - 1280) <= 480
        chosen.add(frozenset(backward))
    assert len(chosen) > 1


def test_forward_none_thresholds_decide_backward_alone():
    recipe = make_recipe(PROFILE, RecipeConfig(device="none", forward="none"))
    assert _quantized(recipe) == {"L0.qkv.wgrad", "L0.proj.dgrad", "L0.proj.wgrad",
                                  "L0.fc1.dgrad", "L0.fc2.dgrad", "L0.fc2.wgrad"}
    assert recipe.logits is None  # not --pgq-logits: reported only


def test_logits_gemms_join_the_recipe():
    # logits.fprop margin inf: quantized; dgrad .08, wgrad .3 kept; totals 7200 + 1920
    recipe = make_recipe(PROFILE, RecipeConfig(device="none", logits=True))
    assert {n for n in _quantized(recipe) if n.startswith("logits")} == {"logits.fprop"}
    assert recipe.logits == SiteFormats("none", "none", "none", overrides=(
        ("fprop.x", INT8.x), ("fprop.w", INT8.w)))
    assert recipe.fraction == pytest.approx((5280 + 640) / (TOTAL + 1920))
    assert "logits fprop" in summary(recipe) and "linear + logits FLOPs" in summary(recipe)


def test_adversarial_with_logits_quantizes_the_decisive_gradient():
    # target 5920; ascending: logits.dgrad .08, logits.wgrad .3, proj.fprop .5, qkv.dgrad .5,
    # fc1.wgrad .8, fc2.wgrad 1, fc2.dgrad 1.5, fc1.fprop 2, qkv.wgrad 2 -> 5760, then
    # proj.wgrad 6080: a tie at 160, the shorter prefix wins
    recipe = make_recipe(PROFILE, RecipeConfig(device="none", logits=True, mode="adversarial"))
    assert {"logits.dgrad", "logits.wgrad"} <= _quantized(recipe)
    assert "L0.proj.wgrad" not in _quantized(recipe)
    ops = resolve(recipe.logits)
    assert ops.dgrad_dy.name == INT8.dy and ops.fprop_x is None
