"""A method in one folder (``toy_method/``, < 60 lines, nothing in training/ or precision/
touched) adds a policy and an overlay; the overlay survives SNIP refreshes, a checkpoint and
a resume."""

import json
from pathlib import Path

from pretrain_runner import FAST_ARGS, launch, read_metrics
from toy_method import HIGH, PROMOTED

TOY = Path(__file__).with_name("toy_method")
SNIP = ["--precision", "snip", "--snip-start", "2", "--snip-interval", "2", "--snip-apply-lag",
        "1", "--train-iters", "6"]


def _run(run_dir, *flags):
    return launch([*FAST_ARGS, "--run-dir", str(run_dir), *flags],
                  script=TOY / "pretrain_toy.py")


def _plan(path):
    return json.loads(Path(path).read_text())


def test_method_folder_is_small():
    assert sum(len(f.read_text().splitlines()) for f in TOY.glob("*.py")) < 60


def test_toy_policy_makes_the_base_plan(tmp_path):
    _run(tmp_path / "toy", "--precision", "toy", "--train-iters", "4", "--no-save",
         "--log-interval", "3", "--toy-promote-at", "2")
    steps = {r["step"]: r for r in read_metrics(tmp_path / "toy") if "loss" in r}
    assert sorted(steps) == [1, 3, 4]
    # step 2's event (not logged) and the switch it caused at step 3 are in step 3's record
    assert steps[3]["toy_promoted"] == PROMOTED
    assert steps[3]["precision_changed_sites"] == [PROMOTED]
    assert "toy_promoted" not in steps[4] and "precision_changed_sites" not in steps[4]
    plan = _plan(tmp_path / "toy" / "precision_plan.json")
    assert plan["method"] == "toy+promote"  # the base is the toy policy's
    assert plan["sites"]["L1.qkv"]["x"] == "fp8_e4m3@tile128"
    assert plan["sites"]["L2.fc1"]["x"] == "fp4_e2m1@tile128"


def test_overlay_survives_snip_refreshes_and_a_resume(tmp_path):
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    _run(first, *SNIP, "--toy-promote-at", "1", "--save", str(ckpt), "--exit-interval", "4")
    steps = {r["step"]: r for r in read_metrics(first) if "loss" in r}
    assert steps[1]["toy_promoted"] == PROMOTED
    assert steps[2]["precision_changed_sites"] == [PROMOTED]  # landed at the next boundary
    refreshes = sorted((first / "snip").glob("step_*/plan.json"))
    assert refreshes and all(_plan(p)["sites"][PROMOTED] != HIGH.to_dict() for p in refreshes)
    final = _plan(first / "precision_plan.json")
    assert final["sites"][PROMOTED] == HIGH.to_dict() and final["method"] == "snip+promote"
    assert (final["sites"] != {**_plan(refreshes[0])["sites"], PROMOTED: HIGH.to_dict()} or
            len(refreshes) == 1)  # the base really is SNIP's latest plan
    _run(second, *SNIP, "--load", str(ckpt), "--no-save")  # no --toy-promote-at this time
    resumed = _plan(second / "precision_plan.json")
    assert resumed["sites"][PROMOTED] == HIGH.to_dict()  # the overlay came from the checkpoint
    last = _plan(sorted((second / "snip").glob("step_*/plan.json"))[-1])
    assert resumed["sites"] == {**last["sites"], PROMOTED: HIGH.to_dict()}
