"""tools/gaussws_hint.py: a hand-made metrics file -> the PrecisionPlan ``--precision-plan``
reads, every site's formats decided by hand from the file's numbers."""

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_ext.precision.plan import load_plan
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.sites import all_site_ids

REPO = Path(__file__).parents[4]
_SPEC = importlib.util.spec_from_file_location("_gaussws_hint_tool",
                                               REPO / "tools" / "gaussws_hint.py")
TOOL = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(TOOL)

# site -> (mean, max) at the last step; min is irrelevant to the hint
END = {"L0.proj": (3.5, 3.9),   # every tile <= 4: FP4 by max and by mean
       "L0.fc2": (3.8, 4.2),    # one tile above 4: FP4 by mean only
       "L1.proj": (5.0, 5.6),   # FP8 either way
       "L1.fc2": (4.0, 4.0)}    # exactly at the bound: FP4 (<=)
FP8, FP4 = UNIFORM["fp8"], UNIFORM["fp4"]
W_ONLY = (FP8.x, FP4.w, FP8.dy)


def write_run(run, num_layers=None):
    run.mkdir()
    early = {"step": 10, **{f"gaussws_b_{s}/{sid}": 6.0 for sid in END
                            for s in ("mean", "min", "max")}}  # all FP8 at step 10
    late = {"step": 20, "loss": 5.0}
    for sid, (mean, top) in END.items():
        late.update({f"gaussws_b_mean/{sid}": mean, f"gaussws_b_min/{sid}": mean - 0.5,
                     f"gaussws_b_max/{sid}": top})
    (run / "metrics.jsonl").write_text(json.dumps(early) + "\n" + json.dumps(late) + "\n")
    if num_layers is not None:
        (run / "args.json").write_text(json.dumps({"num_layers": num_layers}))


def formats(plan, sid):
    f = plan.formats(sid)
    return f.x, f.w, f.dy


@pytest.mark.parametrize("stat,fp4", [("max", {"L0.proj", "L1.fc2"}),
                                      ("mean", {"L0.proj", "L0.fc2", "L1.fc2"})])
def test_plan_from_hand_made_widths(tmp_path, capsys, stat, fp4):
    write_run(tmp_path / "run", num_layers=3)  # args.json: a third, unsampled layer
    out = tmp_path / "plan.json"
    assert TOOL.main([str(tmp_path / "run"), "--out", str(out), "--stat", stat]) == 0
    plan = load_plan(str(out))  # what --precision-plan reads
    plan.check_model(3)
    assert plan.method == "gaussws-hint" and plan.step == 20
    assert list(plan.sites) == all_site_ids(3)
    for sid in all_site_ids(3):
        expect = W_ONLY if sid in fp4 else (FP8.x, FP8.w, FP8.dy)
        assert formats(plan, sid) == expect, sid
    assert f"{len(fp4)} of 4 sampled sites" in capsys.readouterr().out


def test_roles_all_threshold_and_layers(tmp_path):
    write_run(tmp_path / "run")  # no args.json: layers 0-1 from the sites
    out = tmp_path / "plan.json"
    assert TOOL.main([str(tmp_path / "run" / "metrics.jsonl"), "--out", str(out),
                      "--fp4-roles", "all", "--fp4-max-bits", "3.95"]) == 0
    plan = load_plan(str(out))
    assert list(plan.sites) == all_site_ids(2)
    assert formats(plan, "L0.proj") == (FP4.x, FP4.w, FP4.dy)
    assert all(formats(plan, sid) == (FP8.x, FP8.w, FP8.dy)
               for sid in all_site_ids(2) if sid != "L0.proj")


@pytest.mark.parametrize("args,message", [
    (["missing"], "does not exist"),
    (["plain"], "not a --gaussws run"),
    (["run", "--num-layers", "1"], "samples layer 1; --num-layers 1 is too few"),
    (["run", "--num-layers", "0"], "--num-layers must be >= 1"),
])
def test_bad_input_is_one_line(tmp_path, capsys, args, message):
    write_run(tmp_path / "run")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "metrics.jsonl").write_text('{"step": 1, "loss": 8.0}\n')
    argv = [str(tmp_path / args[0]), *args[1:], "--out", str(tmp_path / "p.json")]
    assert TOOL.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "p.json").exists()
