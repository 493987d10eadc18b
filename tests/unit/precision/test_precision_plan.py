"""PrecisionPlan: JSON round trip, a hash that names the content, one-line validation errors,
and the plans the flags make."""

import argparse
import hashlib
import json

import pytest

from megatron_ext.precision.extension import PrecisionRun, add_arguments
from megatron_ext.precision.plan import PrecisionPlan, load_plan, save_plan
from megatron_ext.precision.policies import UNIFORM, PolicySet, uniform_plan
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.errors import UsageError

PLAN = PrecisionPlan(
    {"L10.fc2": SiteFormats("fp8_e4m3@tile128", "fp8_e4m3@block128", "fp8_e4m3@tile128"),
     "L2.qkv": SiteFormats("fp4_e2m1@tile128", "fp4_e2m1@block128", "fp4_e2m1@tile128+sr",
                           overrides=(("wgrad.x", "bf16"),)),
     "L2.proj": SiteFormats("none", "mxfp8", "none")},
    method="snip", step=5000, budget=0.5, objective=1.25e-3, stage_fp4_frac=[0.25, 0.0])

# sha256 of the canonical JSON of PLAN: changing the JSON layout changes it (bump VERSION)
PLAN_HASH = "6c60abd50435ee082472a95c9cd08c28200259d1b59560514b8cd872d7d508a1"


def test_json_round_trip_keeps_everything():
    again = PrecisionPlan.from_json(PLAN.to_json())
    assert again == PLAN and again.to_json() == PLAN.to_json()
    assert again.sites["L2.qkv"].operand("wgrad", "x") == "bf16"
    assert again.sites["L2.qkv"].operand("fprop", "x") == "fp4_e2m1@tile128"


def test_save_plan_writes_a_loadable_file_and_no_temp_file(tmp_path):
    path = tmp_path / "new" / "plan.json"
    save_plan(PLAN, str(path))
    save_plan(PLAN.replace(step=6000), str(path))  # replaced in place
    assert load_plan(str(path)) == PLAN.replace(step=6000)
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]


def test_sites_are_written_in_layer_then_site_order():
    assert list(json.loads(PLAN.to_json())["sites"]) == ["L2.qkv", "L2.proj", "L10.fc2"]


def test_hash_is_stable_and_names_the_content():
    canonical = json.dumps(json.loads(PLAN.to_json()), sort_keys=True, separators=(",", ":"))
    assert PLAN.hash == hashlib.sha256(canonical.encode()).hexdigest() == PLAN_HASH
    reordered = PrecisionPlan(dict(reversed(list(PLAN.sites.items()))), method="snip",
                              step=5000, budget=0.5, objective=1.25e-3,
                              stage_fp4_frac=(0.25, 0.0))
    assert reordered.hash == PLAN_HASH
    spelled = PrecisionPlan({"L0.fc1": SiteFormats("FP8_E4M3@Tile128", "mxfp4", "NONE")})
    assert spelled.hash == PrecisionPlan({"L0.fc1": SiteFormats("fp8_e4m3@tile128", "mxfp4",
                                                                "none")}).hash
    assert PLAN.replace(step=5001).hash != PLAN_HASH
    assert PLAN.replace(sites={**PLAN.sites, "L0.fc1": UNIFORM["fp8"]}).hash != PLAN_HASH


BAD = {
    "unknown site": ({"version": 1, "sites": {"L0.attn": UNIFORM["fp8"].to_dict()}},
                     "bad site id 'L0.attn'"),
    "unknown format": ({"version": 1, "sites": {"L0.qkv": {"x": "fp7", "w": "bf16",
                                                           "dy": "bf16"}}},
                       "site L0.qkv: unknown format 'fp7'"),
    "missing role": ({"version": 1, "sites": {"L0.qkv": {"x": "bf16", "w": "bf16"}}},
                     "missing ['dy']"),
    "bad override": ({"version": 1, "sites": {"L0.qkv": {**UNIFORM["fp8"].to_dict(),
                                                         "overrides": {"fprop.dy": "bf16"}}}},
                     "bad override operand(s) ['fprop.dy']"),
    "no version": ({"sites": {}}, "need \"version\": 1"),
    "unknown key": ({"version": 1, "sites": {}, "budgett": 0.5}, "unknown plan key(s)"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_validation_errors_name_the_problem(name):
    data, fragment = BAD[name]
    with pytest.raises(ValueError) as info:
        PrecisionPlan.from_dict(data)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_load_plan_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read '.*nope.json': No such file"):
        load_plan(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1,\n "sites": }')
    with pytest.raises(ValueError, match="is not valid JSON: Expecting value at line 2"):
        load_plan(str(bad))
    good = tmp_path / "plan.json"
    good.write_text(PLAN.to_json())
    assert load_plan(str(good)) == PLAN


def _args(*argv, num_layers=4):
    parser = argparse.ArgumentParser()
    add_arguments(parser, PolicySet())
    args = parser.parse_args(argv)
    args.num_layers = num_layers
    return args


def _flags_plan(args):
    """The effective plan the flags make (base + the keep overlay), as training starts it."""
    run = PrecisionRun()
    run.validate(args)
    return run.controller.effective()


def test_flags_make_uniform_plans_with_kept_layers():
    plan = _flags_plan(_args("--precision", "uniform:fp4", "--keep-first-last-layers-bf16", "1"))
    assert plan.method == "uniform:fp4+keep1bf16"
    assert ([plan.formats(f"L{i}.fc1") for i in range(4)] ==
            [UNIFORM["bf16"], UNIFORM["fp4"], UNIFORM["fp4"], UNIFORM["bf16"]])
    assert UNIFORM["fp4"].dy == "fp4_e2m1@tile128+sr"  # SNIP §6.1: stochastic rounding for dy
    assert _flags_plan(_args()) is None
    assert _flags_plan(_args("--precision", "uniform:fp8", "--keep-first-last-layers-bf16",
                             "2")).sites == uniform_plan("bf16", 4).sites


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "mxfp8", "fp8_e4m3@row", "int8@tile128",
                                  "fp6_e3m2@tile128", "nvfp4+sr"])
def test_uniform_takes_any_registered_format(name):
    """``uniform:<format>``: that format for x, w and dy of every site (the recipes keep their
    own mixed layouts: ``uniform:fp4`` is not ``fp4_e2m1`` thrice)."""
    plan = _flags_plan(_args("--precision", f"uniform:{name}"))
    assert plan.method == f"uniform:{name}"
    assert ({plan.formats(f"L{i}.{s}") for i in range(4) for s in ("qkv", "fc2")}
            == {SiteFormats(name, name, name)})
    assert _flags_plan(_args("--precision", "uniform:fp4")).formats("L0.qkv") == UNIFORM["fp4"]


def test_flag_errors_are_one_line_usage_errors(tmp_path):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(PLAN.to_json())  # has layer 10
    cases = [
        (("--precision", "uniform:fp6"), "--precision: unknown precision 'uniform:fp6' in this "
                                         "run; choose one of "),  # every offered spelling
        (("--precision", "uniform"), "uniform:bf16, uniform:fp8, uniform:fp4"),
        (("--precision", "uniform:none"),
         "uniform:fp4-tensor, uniform:wgrad-x4-token, uniform:wgrad-x8-token, uniform:<format>"),
        (("--precision", "uniform:"), "unknown precision 'uniform:'"),
        (("--precision", "uniform:fp8", "--precision-plan", str(plan_file)), "exclude each other"),
        (("--keep-first-last-layers-bf16", "1"), "needs --precision or --precision-plan"),
        (("--precision", "uniform:fp8", "--keep-first-last-layers-bf16", "-1"), "must be >= 0"),
        (("--precision", "uniform:fp8", "--keep-first-last-layers-bf16", "9"),
         "--keep-first-last-layers-bf16 9: the model has 4 layers, so the first and last 9 "
         "overlap; give at most 2"),  # not a silent all-BF16 run
        (("--precision-plan", str(plan_file)),
         "--precision-plan: unknown site L10.fc2: the model has layers 0-3"),
        (("--precision-plan", str(tmp_path / "missing.json")), "--precision-plan: cannot read"),
    ]
    for argv, fragment in cases:
        with pytest.raises(UsageError) as info:
            _flags_plan(_args(*argv))
        assert fragment in str(info.value), argv
