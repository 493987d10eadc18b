"""Promoted formats: the documented lifts, and never a narrower operand (every format)."""

from __future__ import annotations

import pytest

from megatron_ext.formats import available, get_format
from megatron_ext.methods.gnmr.decisions import HIGH_CHOICES
from megatron_ext.methods.gnmr.promote import promoted_formats, promotion_overlay
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import PASSTHROUGH, SiteFormats
from megatron_ext.sites import OPERANDS, ROLES

FP8 = SiteFormats("fp8_e4m3@tile128", "fp8_e4m3@block128", "fp8_e4m3@tile128")
BF16 = SiteFormats("bf16", "bf16", "bf16")


def test_auto_lifts_one_class():
    assert promoted_formats(UNIFORM["fp4"], "auto") == FP8
    assert promoted_formats(UNIFORM["fp8"], "auto") == BF16
    assert promoted_formats(BF16, "auto") == BF16
    mixed = SiteFormats("mxfp4", "mxfp8", PASSTHROUGH)
    assert promoted_formats(mixed, "auto") == SiteFormats("fp8_e4m3@tile128", "bf16", "none")
    assert promoted_formats(SiteFormats("nvfp4", "nvfp4", "nvfp4"), "auto") == FP8


def test_explicit_recipes():
    assert promoted_formats(UNIFORM["fp4"], "bf16") == BF16
    assert promoted_formats(UNIFORM["fp4"], "fp8") == FP8
    # already as wide as the recipe: kept as it is (another FP8 layout, or wider)
    assert (promoted_formats(SiteFormats("mxfp8", "fp8_e5m2", "bf16"), "fp8") ==
            SiteFormats("mxfp8", "fp8_e5m2", "bf16"))


def test_overrides_are_lifted_by_role():
    base = SiteFormats("bf16", "bf16", "bf16", overrides=(("wgrad.x", "fp4_e2m1@tile128"),
                                                            ("dgrad.w", "fp8_e4m3@block128")))
    lifted = promoted_formats(base, "auto")
    assert dict(lifted.overrides) == {"wgrad.x": "fp8_e4m3@tile128", "dgrad.w": "bf16"}


def _width(name: str) -> float:
    return float("inf") if name == PASSTHROUGH else get_format(name).bits


@pytest.mark.parametrize("high", HIGH_CHOICES)
def test_never_demotes(high):
    """Every registered format (and passthrough) in every role and as an override."""
    for name in [*available(), PASSTHROUGH]:
        for role in ROLES:
            base = SiteFormats(**{role: name})
            lifted = promoted_formats(base, high)
            for op in OPERANDS:
                gemm, r = op.split(".")
                assert _width(lifted.operand(gemm, r)) >= _width(base.operand(gemm, r)), (
                    name, role, high)
            if _width(name) >= 16:
                assert lifted == base  # already high: untouched
        base = SiteFormats(overrides=(("fprop.x", name),))
        assert _width(promoted_formats(base, high).operand("fprop", "x")) >= _width(name)


@pytest.mark.parametrize("high", ["fp8", "bf16"])
def test_explicit_recipe_is_idempotent(high):
    for name in available():
        once = promoted_formats(SiteFormats(name, name, name), high)
        assert promoted_formats(once, high) == once


def test_overlay_holds_only_changed_sites():
    base = {f"L{i}.{s}": UNIFORM["fp4"] for i in range(2) for s in ("qkv", "proj", "fc1", "fc2")}
    base["L1.proj"] = BF16  # the base plan keeps this one high
    overlay = promotion_overlay(base, ["L1"], "auto")
    assert set(overlay) == {"L1.qkv", "L1.fc1", "L1.fc2"}
    assert all(f == FP8 for f in overlay.values())
    assert promotion_overlay(base, ["L0.fc2"], "bf16") == {"L0.fc2": BF16}
    assert promotion_overlay(base, ["L1.proj"], "auto") == {}


def test_auto_keeps_a_per_token_operand_per_token():
    """GNMR §5.1: wgrad's saved activation in 4 bits per token is promoted to 8 bits per
    token (not to uniform:fp8's tiles along T); the passthrough operands stay."""
    lifted = promoted_formats(UNIFORM["wgrad-x4-token"], "auto")
    assert lifted == UNIFORM["wgrad-x8-token"]
    assert promoted_formats(lifted, "auto") == SiteFormats(
        "none", "none", "none", overrides=(("wgrad.x", "bf16"),))
