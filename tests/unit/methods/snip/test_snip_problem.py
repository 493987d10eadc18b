"""problem.json: round trip, validation messages, and tools/snip_analyze.py end to end."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.methods.snip.ilp import solve
from megatron_ext.methods.snip.problem import Option, Problem, Site
from megatron_ext.methods.snip.candidates import parse_option_name
from megatron_ext.methods.snip.synthetic import option_name, roles_formats, synthetic_problem
from megatron_ext.sites import ROLES

REPO = Path(__file__).resolve().parents[4]
TOOL = REPO / "tools" / "snip_analyze.py"

SMALL = {
    "num_stages": 2,
    "stage_fixed_time": [0.5, 0.25],
    "sites": [
        {"site": "L0.fc1", "stage": 0, "options": [
            {"name": "fp8", "q": 0.0, "fp4_flops": 0, "flops": 6, "time": 3.0},
            {"name": "fp4", "q": 1.0, "fp4_flops": 6, "flops": 6, "time": 1.5}]},
        {"site": "L1.fc1", "stage": 1, "options": [
            {"name": "fp8", "q": 0.0, "fp4_flops": 0, "flops": 6, "time": 3.0},
            {"name": "fp4", "q": 2.0, "fp4_flops": 6, "flops": 6}]},
    ],
}


def test_json_round_trip(tmp_path):
    problem = synthetic_problem(5, stages=2, seed=4)
    path = tmp_path / "problem.json"
    problem.save(str(path))
    loaded = Problem.load(str(path))
    assert loaded == problem and loaded.meta == problem.meta
    assert Problem.from_dict(json.loads(json.dumps(loaded.to_dict()))) == problem
    assert not list(tmp_path.glob(".tmp_*"))  # the temp file was renamed away


def test_small_problem_defaults():
    problem = Problem.from_dict(SMALL)
    assert problem.sites[1].options[1].time == 0.0  # "time" is optional
    assert (Problem.from_dict({k: v for k, v in SMALL.items() if k != "stage_fixed_time"})
            .stage_fixed_time == (0.0, 0.0))
    assert solve(problem, 0.5, "paper").choice == {"L0.fc1": "fp4", "L1.fc1": "fp4"}
    assert solve(problem, 0.5, "none").choice == {"L0.fc1": "fp4", "L1.fc1": "fp8"}


def test_snip_options_map_to_fp4_roles():
    formats = roles_formats(("x", "w"))
    assert (formats.x, formats.w, formats.dy) == ("fp4_e2m1@tile128", "fp4_e2m1@block128",
                                                  "fp8_e4m3@tile128")
    assert roles_formats(()).dy == "fp8_e4m3@tile128"
    assert roles_formats(ROLES).dy == "fp4_e2m1@tile128+sr"
    assert option_name(("x", "w")) == ("x=fp4_e2m1@tile128,w=fp4_e2m1@block128,"
                                       "dy=fp8_e4m3@tile128")  # the spelling training uses
    assert parse_option_name(option_name(("x", "w"))) == formats


def test_synthetic_costs_are_the_closed_form():
    """tinyllama (h 2048, 32 heads of 64, 4 KV groups, v 32000, T = s = 2048): qkv has
    N = 2048 + 2*4*64 = 2560, K = 2048; an option with f FP4 GEMMs takes
    (f/4 + (3 - f)/2) GEMMs' BF16 time; attention core 6·T·s·h per layer, output 6·T·v·h."""
    problem = synthetic_problem(2, stages=2, shape="tinyllama")
    gemm, rate = 2 * 2048 * 2560 * 2048, 989e12
    options = {o.name: o for o in problem.sites[0].options}
    for roles, fp4 in {(): 0, ROLES: 3, ("x", "w"): 1, ("dy",): 0}.items():
        name = option_name(roles)
        assert (options[name].fp4_flops, options[name].flops) == (fp4 * gemm, 3 * gemm)
        assert options[name].time == pytest.approx((fp4 / 4 + (3 - fp4) / 2) * gemm / rate,
                                                   rel=1e-15)
    attention, output = 6 * 2048 * 2048 * 2048, 6 * 2048 * 32000 * 2048
    assert problem.stage_fixed_time == pytest.approx((attention / rate,
                                                      (attention + output) / rate), rel=1e-15)
    interleaved = synthetic_problem(4, stages=2, shape="tinyllama", stage_of=[0, 1, 0, 1])
    assert [s.stage for s in interleaved.sites[::4]] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="stage_of must give a stage"):
        synthetic_problem(4, stages=2, stage_of=[0, 1, 2, 1])


def _mutated(path: str, value):
    data = copy.deepcopy(SMALL)
    *keys, last = path.split("/")
    target = data
    for key in keys:
        target = target[int(key) if key.isdigit() else key]
    if value is KeyError:
        del target[last]
    else:
        target[int(last) if last.isdigit() else last] = value
    return data


@pytest.mark.parametrize("path, value, message", [
    ("sites", [], "'sites' must be a non-empty list"),
    ("num_stages", KeyError, "missing key 'num_stages'"),
    ("num_stages", 0, "num_stages must be a positive integer"),
    ("num_stages", 3, "stage_fixed_time has 2 entries for 3 stages"),
    ("stage_fixed_time/0", -1.0, "stage_fixed_time must be finite and >= 0"),
    ("version", 2, "unsupported version"),
    ("extra", 1, "unknown key 'extra'"),
    ("sites/0/options", [], "sites[0] (L0.fc1): 'options' must be a non-empty list"),
    ("sites/0/stage", 2, "stage 2 out of range 0..1"),
    ("sites/0/stage", 1, "stage 0 has no sites"),
    ("sites/0/stage", "0", "expected an integer"),
    ("sites/1/site", "L0.fc1", "duplicate site id"),
    ("sites/0/options/0/q", KeyError, "options[0]: missing key 'q'"),
    ("sites/0/options/0/q", "high", "q: expected a finite number"),
    ("sites/0/options/0/q", float("inf"), "q: expected a finite number"),
    ("sites/0/options/1/flops", -6, "flops must be > 0"),
    ("sites/0/options/1/fp4_flops", -1, "fp4_flops must lie in [0, flops]"),
    ("sites/0/options/1/fp4_flops", 7, "fp4_flops must lie in [0, flops]"),
    ("sites/0/options/1/flops", 12, "differs from the site's"),
    ("sites/0/options/1/time", -1, "time must be >= 0"),
    ("sites/0/options/1/name", "fp8", "duplicate option name"),
    ("sites/0/options/0/fp4_flops", 3, "no option with fp4_flops == 0"),
    ("sites/0/options/0/typo", 1, "unknown key 'typo'"),
])
def test_validation_errors_are_one_line(path, value, message):
    with pytest.raises(ValueError) as err:
        Problem.from_dict(_mutated(path, value))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="no options"):
        Problem((Site("a", 0, ()),))
    with pytest.raises(ValueError, match="no sites"):
        Problem(())
    Problem((Site("a", 0, (Option("fp8", 0.0, 0.0, 1.0),)),))


def test_load_reports_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        Problem.load(str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid JSON"):
        Problem.load(str(tmp_path / "broken.json"))
    (tmp_path / "list.json").write_text("[]", encoding="utf-8")
    with pytest.raises(ValueError, match="expected an object"):
        Problem.load(str(tmp_path / "list.json"))


# ------------------------------------------------------------------------ the CLI


def run_tool(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def test_cli_writes_the_solution(tmp_path):
    problem = synthetic_problem(22, stages=4, seed=0, shape="tinyllama")
    problem.save(str(tmp_path / "problem.json"))
    out = tmp_path / "plan.json"
    proc = run_tool("--problem", tmp_path / "problem.json", "--budget", "0.75",
                    "--stage-balance", "time", "--solution", out, "--time-limit", "10",
                    "--mip-gap", "0", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("optimal: objective")
    plan = json.loads(out.read_text(encoding="utf-8"))
    expected = solve(problem, 0.75, "time")
    assert plan["status"] == "optimal" and plan["choice"] == expected.choice
    assert plan["objective"] == pytest.approx(expected.objective)
    assert len(plan["stage_fp4_fraction"]) == 4 and plan["fp4_fraction"] >= 0.75
    assert plan["problem_meta"]["synthetic"]["num_layers"] == 22
    for key in ("solve_time", "mip_gap", "stage_time", "time_bound", "budget"):
        assert key in plan

    warm = run_tool("--problem", tmp_path / "problem.json", "--budget", "0.95",
                    "--stage-balance", "paper", "--solution", tmp_path / "fallback.json",
                    "--warm-start", out)
    assert warm.returncode == 0 and warm.stderr.startswith("warning:")
    assert (json.loads((tmp_path / "fallback.json").read_text())["status"] ==
            "infeasible-fallback")


@pytest.mark.parametrize("args, message", [
    (["--budget", "1.5"], "--budget: must be a fraction in [0, 1]"),
    (["--budget", "half"], "--budget: not a number"),
    (["--budget", "0.5", "--stage-balance", "even"], "invalid choice"),
    (["--budget", "0.5", "--time-limit", "0"], "--time-limit: must be > 0"),
    (["--budget", "0.5", "--mip-gap", "-1"], "--mip-gap: must be >= 0"),
    (["--budget", "0.5", "--problem", "missing.json"], "cannot read"),
    (["--budget", "0.5", "--problem", "bad.json"], "'options' must be a non-empty list"),
    (["--budget", "0.5", "--warm-start", "bad.json"], "--warm-start"),
    (["--budget", "0.5", "--solution", "no/such/dir/plan.json"], "cannot write"),
    (["--budget", "0.5", "--out", "plan.json"], "option 'fp8' of L0.fc1 is a name, not formats"),
    (["--budget", "0.5", "--solution", "x.json", "--out", "x.json"],
     "--out and --solution name the same file"),
])
def test_cli_bad_input_is_one_error_line(tmp_path, args, message):
    Problem.from_dict(SMALL).save(str(tmp_path / "problem.json"))
    bad = copy.deepcopy(SMALL)
    bad["sites"][0]["options"] = []
    (tmp_path / "bad.json").write_text(json.dumps(bad), encoding="utf-8")
    defaults = {"--problem": "problem.json", "--solution": "plan.json"}
    for flag, value in defaults.items():
        if flag not in args and (flag != "--solution" or "--out" not in args):
            args = [*args, flag, value]
    args = [str(tmp_path / a) if a.endswith(".json") else a for a in args]
    proc = run_tool(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (
        proc.stderr)
    assert not (tmp_path / "plan.json").exists()


def test_cli_help():
    proc = run_tool("--help")
    assert proc.returncode == 0 and "--stage-balance" in proc.stdout
