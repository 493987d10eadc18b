"""The plan controller: overlays compose over any base in any order, ``raise`` never lowers an
operand, changes are reported by site, state round-trips exactly (checkpoint resume)."""

import pytest

from megatron_ext.precision.controller import Overlay, PlanController, compose, raise_formats
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.policies import UNIFORM, uniform_plan
from megatron_ext.precision.site_formats import SiteFormats

FP4, FP8, BF16 = UNIFORM["fp4"], UNIFORM["fp8"], UNIFORM["bf16"]


def test_raise_takes_the_higher_precision_of_each_operand():
    mixed = SiteFormats("fp4_e2m1@tile128", "bf16", "fp8_e4m3@tile128")
    assert raise_formats(mixed, FP8) == SiteFormats(FP8.x, "bf16", FP8.dy)
    assert raise_formats(BF16, FP8) == BF16  # a site already high stays high
    assert raise_formats(FP4, SiteFormats()) == SiteFormats()  # "none" is highest
    lifted = raise_formats(SiteFormats(*FP8.to_dict().values(), overrides=(("wgrad.x", "bf16"),)),
                           FP4)
    assert lifted.operand("wgrad", "x") == "bf16" and lifted.x == FP8.x


def test_overlays_compose_over_the_base():
    base = uniform_plan("fp4", 2)
    keep = Overlay("precision", "keep1bf16", {"L0.qkv": BF16, "L1.fc2": BF16})
    promote = Overlay("gnmr", "promotions", {"L0.qkv": FP8, "L1.proj": FP8}, rule="raise")
    plan = compose(base, [keep, promote])
    assert plan.method == "uniform:fp4+keep1bf16+promotions"
    assert plan.formats("L0.qkv") == BF16  # raised to FP8 would lower BF16: stays
    assert plan.formats("L1.proj") == FP8 and plan.formats("L1.fc2") == BF16
    assert plan.formats("L0.fc1") == FP4
    fallback = Overlay("faults", "fallback", {"L1.proj": FP4, "L1.fc1": FP8})
    set_after = compose(base, [promote, fallback])
    assert set_after.formats("L1.fc1") == FP8  # "set" replaces the base's formats
    assert set_after.formats("L1.proj") == FP8  # and a raise lifts them, set before or after
    assert set_after == compose(base, [fallback, promote])
    assert compose(base, [Overlay("x", "empty", {})]).method == "uniform:fp4"


def test_a_new_base_keeps_the_overlays():
    ctl = PlanController()
    ctl.set_base(uniform_plan("fp8", 2))
    ctl.set_overlay("gnmr", "promotions", {"L1.fc1": BF16}, rule="raise")
    assert ctl.changes() == sorted(uniform_plan("fp8", 2).sites)  # nothing applied yet
    ctl.applied = ctl.effective()
    assert ctl.changes() is None
    ctl.set_base(uniform_plan("fp4", 2).replace(method="snip"))  # a SNIP refresh
    plan = ctl.effective()
    assert plan.formats("L1.fc1") == BF16 and plan.formats("L0.fc1") == FP4
    assert "L1.fc1" not in ctl.changes() and "L0.fc1" in ctl.changes()
    ctl.applied = plan.replace(stage_fp4_frac=[0.9])  # the commit fills in stage fractions
    assert ctl.changes() is None


def test_state_round_trips_exactly():
    ctl = PlanController()
    ctl.set_base(PrecisionPlan({"L0.qkv": FP4}, method="snip", step=40, budget=0.5))
    ctl.set_overlay("precision", "keep1bf16", {"L0.fc2": BF16})
    ctl.set_overlay("gnmr", "promotions", {"L0.qkv": FP8}, rule="raise")
    restored = PlanController()
    restored.load_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict()
    assert list(restored.overlays) == [("precision", "keep1bf16"), ("gnmr", "promotions")]
    assert restored.effective() == ctl.effective()
    old = PlanController()  # a checkpoint written before the controller: {"plan": ...}
    old.load_state_dict({"plan": uniform_plan("fp8", 1).to_dict()})
    assert old.effective() == uniform_plan("fp8", 1) and not old.overlays


def test_bad_rule_is_refused():
    with pytest.raises(ValueError, match="overlay rule"):
        Overlay("x", "y", {}, rule="lower")


def _lift_l0(base):
    """A derived overlay: L0.qkv one step up from whatever the base holds."""
    return {"L0.qkv": FP8 if base["L0.qkv"] == FP4 else BF16}


def test_a_derived_overlay_follows_the_base_set_after_it():
    ctl = PlanController()
    ctl.set_base(uniform_plan("fp8", 1))
    ctl.set_overlay("gnmr", "promotions", rule="raise", derive=_lift_l0)
    assert ctl.effective().formats("L0.qkv") == BF16
    ctl.set_base(uniform_plan("fp4", 1))  # set after the overlay was laid
    assert ctl.effective().formats("L0.qkv") == FP8
    saved = ctl.state_dict()  # checkpointed as its sites over the current base
    assert saved["overlays"][0]["sites"] == {"L0.qkv": FP8.to_dict()}
    restored = PlanController()
    restored.load_state_dict(saved)
    assert restored.effective() == ctl.effective()


def test_a_derive_that_changes_the_controller_is_refused():
    ctl = PlanController()
    ctl.set_base(uniform_plan("fp4", 1))
    ctl.set_overlay("x", "bad", derive=lambda base: ctl.set_base(uniform_plan("fp8", 1)))
    with pytest.raises(RuntimeError, match="set_base while an overlay is derived"):
        ctl.effective()
    assert ctl.base == uniform_plan("fp4", 1)


def test_any_order_of_laying_the_overlays_gives_one_plan():
    """A SNIP base, GNMR's derived promotions, the kept layers and another ``set`` overlay
    pinning one of their sites: every order of laying them commits the same plan (hash)."""
    from functools import partial
    from itertools import permutations

    from megatron_ext.methods.gnmr.promote import promotion_overlay
    from megatron_ext.precision.policies import keep_overlay

    fp4, fp8 = uniform_plan("fp4", 4), uniform_plan("fp8", 4)
    snip = fp4.replace(sites={**fp4.sites, "L1.qkv": FP8, "L2.fc2": FP8}, method="snip")
    keep = keep_overlay(1, 4)
    overlays = [
        ("gnmr", "promotions", None, "raise",
         partial(promotion_overlay, units=["L1", "L3"], high="auto")),
        (keep.owner, keep.name, keep.sites, keep.rule, None),
        ("faults", "fallback", {"L0.qkv": FP8, "L2.fc1": fp8.sites["L2.fc1"]}, "set", None),
    ]
    hashes = set()
    for order in permutations(overlays):
        ctl = PlanController()
        ctl.set_base(snip)
        for owner, name, sites, rule, derive in order:
            ctl.set_overlay(owner, name, sites, rule, derive)
        plan = ctl.effective()
        hashes.add(plan.hash)
    assert len(hashes) == 1
    assert plan.method == "snip+fallback+keep1bf16+promotions"
    assert plan.formats("L0.qkv") == BF16  # the higher of the two pins
    assert plan.formats("L2.fc1") == FP8 and plan.formats("L2.fc2") == FP8
    assert plan.formats("L1.qkv") == BF16 and plan.formats("L1.fc1") == FP8  # promoted
