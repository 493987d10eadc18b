"""The precision budget tuner (``tools/tune_precision.py``) and ``snip_analyze.py --stats``
on the statistics of one real SNIP run (made once for the module): budgets and per-stage
budgets are met, the Pareto front is monotone, re-layouts move layers between stages,
--explain covers every site, the offline re-solve reproduces the run's own plan, and bad
input is one line, exit status 2 and no files."""

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_ext.precision.cost import flop_report
from megatron_ext.precision.plan import load_plan
from megatron_ext.methods.snip import offline, tune
from megatron_ext.methods.snip.candidates import parse_option_name
from pretrain_runner import FAST_ARGS, REPO, launch

BUDGET, MODE = 0.6, "time"
SNIP = ["--precision", "snip", "--snip-budget", str(BUDGET), "--snip-stage-balance", MODE,
        "--snip-start", "2", "--snip-interval", "0", "--snip-apply-lag", "1"]
TOL = 1e-9


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_{name}_tool", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TUNE = _tool("tune_precision")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-layer SNIP run with one refresh (step 2) at budget 0.6, time balance."""
    run_dir = tmp_path_factory.mktemp("tune") / "run"
    launch([*FAST_ARGS, *SNIP, "--train-iters", "4", "--no-save", "--run-dir", str(run_dir)])
    return run_dir


def _tune(run, out, *flags):
    assert TUNE.main(["--stats", str(run), "--out", str(out), *flags]) == 0
    return json.loads((out / "report.json").read_text())


def test_plans_meet_their_budgets_and_pareto_q_is_monotone(run, tmp_path):
    report = _tune(run, tmp_path / "t")
    points = report["pareto"]["points"]
    assert [p["budget"] for p in points] == [0.25, 0.5, 0.75, 0.8, 0.9]
    assert report["stage_balance"] == MODE  # the run's
    shape = offline.plan_problem(offline.load_refresh(str(run))).shape
    for p in points:
        assert p["status"] == "optimal" and p["fp4_fraction"] >= p["budget"] - TOL
        plan = load_plan(str(tmp_path / "t" / f"plan_b{p['budget']:g}.json"))
        assert plan.method == "snip" and plan.step == 2 and plan.budget == p["budget"]
        assert flop_report(plan.formats, shape).fractions["fp4"] >= p["budget"] - TOL
    objectives = [report["pareto"]["anchor"]["objective"]] + [p["objective"] for p in points]
    assert all(b >= a - 1e-6 * abs(a) for a, b in zip(objectives, objectives[1:]))
    savings = [p["saving"] for p in points]
    assert all(0 < s < 1 for s in savings)
    assert sum(p["knee"] for p in points) == 1
    assert report["pareto"]["knee"] in [p["budget"] for p in points]


def test_knee_is_the_last_budget_before_marginal_cost_exceeds_twice_the_average():
    def curve(*points):
        return [SimpleNamespace(fp4_fraction=f, objective=q) for f, q in points]

    convex = curve((0, 0), (0.1, 0.1), (0.2, 0.2), (0.3, 0.3), (0.4, 1.3))
    assert tune.knee_index(convex) == 3  # average 3.25; the last step costs 10 > 6.5
    assert tune.knee_index(curve((0, 0), (0.5, 1), (1, 2))) == 2  # straight: no knee in range
    assert tune.knee_index(curve((0, 0), (0.1, 1), (1, 1.1))) is None  # steepest first


def test_stage_budgets_are_met_per_stage_with_a_bubble_estimate(run, tmp_path, capsys):
    report = _tune(run, tmp_path / "s", "--stage-budgets", "0.9,0.3",
                   "--pipeline-model-parallel-size", "2")
    (plan,) = report["plans"]
    assert plan["label"] == "stages" and report["pareto"] is None
    assert all(f >= b - TOL for f, b in zip(plan["solution"]["stage_fp4_fraction"], (0.9, 0.3)))
    table = plan["stage_table"]
    assert [s["layers"] for s in table["stages"]] == [[0, 1], [2, 3]]
    assert table["num_microbatches"] == 4 and table["bubble_fraction"] == pytest.approx(1 / 5)
    slowest = max(table["stages"], key=lambda s: s["time"])
    assert [s["bottleneck"] for s in table["stages"]] == [s is slowest for s in table["stages"]]
    assert slowest["idle_fraction"] == pytest.approx(1 / 5)
    assert "<- bottleneck" in capsys.readouterr().out
    saved = load_plan(str(tmp_path / "s" / "plan_stages.json"))
    assert list(saved.stage_fp4_frac) == plan["solution"]["stage_fp4_fraction"]


def test_relayout_moves_layers_between_stages(run, tmp_path):
    refresh = offline.load_refresh(str(run))

    def stages(**layout):
        problem = offline.plan_problem(refresh, layout=offline.Layout(**layout)).problem
        return [s.stage for s in problem.sites[::4]]  # one site per layer

    assert stages() == [0, 0, 0, 0]
    assert stages(pipeline=2) == [0, 0, 1, 1]
    assert stages(pipeline=2, first=1) == [0, 1, 1, 1]
    assert stages(pipeline=3, last=2) == [0, 1, 2, 2]
    report = _tune(run, tmp_path / "r", "--budgets", "0.5", "--pipeline-model-parallel-size",
                   "2", "--decoder-last-pipeline-num-layers", "3")
    assert report["layout"]["layer_stage"] == [0, 1, 1, 1]
    assert len(report["plans"][0]["solution"]["stage_fp4_fraction"]) == 2


def test_explain_lists_every_site(run, tmp_path, capsys):
    why = tmp_path / "why.json"
    report = _tune(run, tmp_path / "e", "--budgets", "0.5,0.75", "--explain", "0.75",
                   "--explain-json", str(why))
    text = capsys.readouterr().out
    explained = json.loads(why.read_text())
    assert explained == report["explain"] and explained["plan"] == "b0.75"
    sites = [s["site"] for s in json.loads((run / "snip" / "step_000002" /
                                            "stats.json").read_text())["sites"]]
    assert [s["site"] for s in explained["sites"]] == sites and len(sites) == 16
    choice = report["plans"][1]["solution"]["choice"]
    for s in explained["sites"]:
        assert s["option"] == choice[s["site"]] and s["dL"] > 0 and s["dW"] > 0
        assert s["q"] == pytest.approx(s["dL"] + s["dW"])
        assert s["next"]["fp4_share"] != s["fp4_share"]
        assert s["site"] in text


def test_snip_analyze_stats_reproduces_the_runs_plan(run, tmp_path):
    out = tmp_path / "plan.json"
    subprocess.run([sys.executable, str(REPO / "tools" / "snip_analyze.py"), "--stats",
                    str(run), "--budget", str(BUDGET), "--out", str(out)],
                   check=True, capture_output=True, cwd=REPO)
    mine = json.loads((tmp_path / "plan.solution.json").read_text())
    refresh = run / "snip" / "step_000002"
    theirs = json.loads((refresh / "solution.json").read_text())
    assert mine["stage_balance"] == MODE and mine["choice"] == theirs["choice"]
    assert mine["objective"] == theirs["objective"]
    plan = load_plan(str(refresh / "plan.json"))
    assert {s: parse_option_name(o) for s, o in mine["choice"].items()} == plan.sites
    assert load_plan(str(out)).sites == plan.sites  # --out is the run's own plan


def test_stats_is_found_in_a_run_directory(tmp_path):
    for step in (2, 10, 9):
        folder = tmp_path / "snip" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        (folder / "stats.json").write_text("{}")
    assert offline.find_stats(str(tmp_path)).endswith("step_000010/stats.json")


@pytest.mark.parametrize("flags, message", [
    (["--stats", "missing"], "cannot read missing"),
    (["--budgets", "0.5,1.5"], "must be a fraction in [0, 1], got 1.5"),
    (["--stage-budgets", "0.5,0.5"], "--stage-budgets has 2 value(s) for 1 pipeline stage(s)"),
    (["--pipeline-model-parallel-size", "3"], "4 layers do not split evenly into 3"),
    (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1"],
     "do not split evenly"),
])
def test_bad_input_is_one_line_exit_2_and_no_files(run, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    argv = ["--stats", str(run), "--out", str(out), *flags]
    assert TUNE.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not out.exists()


def test_statistics_of_an_older_version_are_refused(run, tmp_path, capsys):
    """A stats.json without a statistic the estimator needs (here ``resB``, added in the
    residual-stream estimator) is one line, not a KeyError deep in the analysis."""
    stats = json.loads(next((run / "snip").glob("step_*/stats.json")).read_text())
    for site in stats["sites"]:
        del site["stats"]["resB"]
    old = tmp_path / "stats.json"
    old.write_text(json.dumps(stats))
    out = tmp_path / "out"
    argv = ["--stats", str(old), "--args", str(run / "args.json"), "--out", str(out)]
    assert TUNE.main(argv) == 2
    err = capsys.readouterr().err
    assert "has no statistic 'resB'" in err and err.count("\n") == 1 and not out.exists()


def test_bad_input_exit_status_from_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "tune_precision.py"),
                           "--stats", "x", "--budgets", "1.5", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "error: argument --budgets: must be a fraction in [0, 1], got 1.5"]
    assert not (tmp_path / "o").exists()


def test_device_profile_file_sets_the_time_mode_plans(run, tmp_path):
    """FP4 native and free to quantize (nominal; at this tiny width B200's quantization costs
    more than its FP4 saves) -> the budget is met in FP4; FP4 emulated (h100) -> time mode asks
    for no FP4 (fp4_target 0); a bad file: exit 2 with one line."""
    from megatron_ext.precision.device_profile import PROFILES

    files = {}
    for name in ("nominal", "h100"):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(PROFILES[name].to_json())
    free = _tune(run, tmp_path / "b", "--budgets", "0.5", "--device-profile",
                 str(files["nominal"]))
    h100 = _tune(run, tmp_path / "h", "--budgets", "0.5", "--device-profile", str(files["h100"]))
    on_free, on_h100 = free["plans"][0]["solution"], h100["plans"][0]["solution"]
    assert on_free["fp4_target"] == 0.5 and on_free["fp4_fraction"] >= 0.5 - TOL
    assert on_h100["fp4_target"] == 0.0 and on_h100["fp4_fraction"] == 0.0
    assert on_h100["stage_time"] != on_free["stage_time"]
    files["bad"] = tmp_path / "bad.json"
    files["bad"].write_text("{")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "tune_precision.py"), "--stats",
                           str(run), "--out", str(tmp_path / "x"), "--device-profile",
                           str(files["bad"])], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: --device-profile") and not (tmp_path / "x").exists()
