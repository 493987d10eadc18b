"""Transformer Engine recipe selection (pure: format names + compute capability), and the
guarded import. The TE execution path itself needs a GPU with TE and is not run here."""

import pytest
import torch

from megatron_ext.precision import te
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats

AMPERE, ADA, HOPPER, BLACKWELL, RTX50 = (8, 0), (8, 9), (9, 0), (10, 0), (12, 0)
CURRENT = SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e5m2")
MX = SiteFormats("mxfp8", "mxfp8", "mxfp8")
NV = SiteFormats("nvfp4", "nvfp4", "nvfp4+sr")

CASES = [
    (UNIFORM["fp8"], AMPERE, None),
    (UNIFORM["fp8"], ADA, None),
    (UNIFORM["fp8"], HOPPER, ("Float8BlockScaling", "E4M3")),
    (UNIFORM["fp8"], BLACKWELL, ("Float8BlockScaling", "E4M3")),
    (SiteFormats(UNIFORM["fp8"].x, UNIFORM["fp8"].w, "fp8_e5m2@tile128"), HOPPER,
     ("Float8BlockScaling", "HYBRID")),
    (SiteFormats(UNIFORM["fp8"].x, UNIFORM["fp8"].w, "fp8_e5m2@tile128"), ADA, None),
    (CURRENT, AMPERE, None),
    (CURRENT, ADA, ("Float8CurrentScaling", "HYBRID")),
    (SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e4m3"), HOPPER, ("Float8CurrentScaling", "E4M3")),
    (MX, HOPPER, None),
    (MX, BLACKWELL, ("MXFP8BlockScaling", "E4M3")),
    (SiteFormats("mxfp8", "mxfp8", "mxfp8_e5m2"), BLACKWELL, ("MXFP8BlockScaling", "HYBRID")),
    (MX, RTX50, None),
    (NV, BLACKWELL, ("NVFP4BlockScaling", "E2M1")),
    (NV, HOPPER, None),
    (NV, RTX50, None),
    (SiteFormats("nvfp4", "nvfp4", "nvfp4"), BLACKWELL, None),  # TE rounds dy stochastically
    (UNIFORM["fp4"], BLACKWELL, None),  # E2M1 with 1x128 / 128x128 scales: no TE recipe
    (UNIFORM["bf16"], HOPPER, None),
    (SiteFormats(), HOPPER, None),
    (SiteFormats("mxfp8", "nvfp4", "mxfp8"), BLACKWELL, None),  # mixed roles
    (SiteFormats("mxfp8", "mxfp8", "mxfp8", overrides=(("wgrad.x", "bf16"),)), BLACKWELL, None),
]


@pytest.mark.parametrize("formats,capability,expected", CASES)
def test_recipe_selection(formats, capability, expected):
    got = te.recipe_for(formats, capability)
    assert (None if got is None else tuple(got)) == expected


def test_spelling_does_not_matter():
    spelled = SiteFormats("FP8_E4M3@tile128", "fp8_e4m3@BLOCK128", "fp8_e4m3@tile128")
    assert te.recipe_for(spelled, HOPPER) == te.TERecipe("Float8BlockScaling", "E4M3")


def test_cpu_tensors_never_take_the_te_path():
    assert te.device_recipe(UNIFORM["fp8"], torch.zeros(2)) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_te_import_is_optional():
    assert te.te_pytorch() is None  # not installed here; importing megatron_ext still works
