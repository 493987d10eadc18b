"""``--precision snip`` through the real entry point: refresh files, the plan applied at the
step fixed in advance, the offline tool on the refresh's problem, a resume between a refresh
and its apply step reproducing the uninterrupted run, and bad SNIP flags."""

import json
import os
import subprocess
import sys

import pytest

from megatron_ext.precision.plan import load_plan
from megatron_ext.methods.snip.problem import Problem
from pretrain_runner import FAST_ARGS, REPO, launch, read_metrics, train_losses

SNIP = ["--precision", "snip", "--snip-budget", "0.5", "--snip-start", "2",
        "--snip-interval", "3", "--snip-apply-lag", "2"]


@pytest.fixture(scope="module")
def snip_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("snip") / "run"
    launch([*FAST_ARGS, *SNIP, "--train-iters", "8", "--no-save", "--run-dir", str(run_dir)])
    return run_dir


def test_refreshes_write_statistics_divergences_problem_and_plan(snip_run):
    refreshes = sorted(p.name for p in (snip_run / "snip").iterdir())
    assert refreshes == ["step_000002", "step_000005"]
    out = snip_run / "snip" / "step_000002"
    plan = load_plan(str(out / "plan.json"))
    assert plan.method == "snip" and plan.step == 2 and plan.budget == 0.5
    solution = json.loads((out / "solution.json").read_text())
    assert solution["status"] == "optimal" and solution["fp4_fraction"] >= 0.5 - 1e-9
    div = json.loads((out / "divergence.json").read_text())
    assert len(div["options"]) == 8 and len(div["sites"]) == 16
    assert all(v["q"] > 0 and v["dL"] > 0 and v["dW"] > 0
               for site in div["sites"].values() for v in site.values())
    problem = Problem.load(str(out / "problem.json"))
    assert len(problem.sites) == 16 and problem.meta["step"] == 2
    stats = json.loads((out / "stats.json").read_text())
    assert stats["adam"]["step"] == 3 and stats["loss"] > 0


def _refresh_stats(run_dir) -> dict:
    raw = json.loads((run_dir / "snip" / "step_000002" / "stats.json").read_text())
    return {s["site"]: s["stats"] for s in raw["sites"]}


def test_dgrad_probe_changes_only_the_backward_probe(snip_run, tmp_path):
    """--snip-probe dgrad: the same refresh as the isotropic run's except the backward
    probe's statistics; its noise has the same size per token (‖ξ‖² within a few %)."""
    run_dir = tmp_path / "dgrad"
    launch([*FAST_ARGS, *SNIP, "--snip-probe", "dgrad", "--train-iters", "4", "--no-save",
            "--run-dir", str(run_dir)])
    iso, shaped = _refresh_stats(snip_run), _refresh_stats(run_dir)
    for sid, st in iso.items():
        for key in ("xx", "ww", "dydy", "dgF", "WGdy"):
            assert shaped[sid][key] == pytest.approx(st[key], rel=1e-6), (sid, key)
        assert shaped[sid]["dgB"] != pytest.approx(st["dgB"], rel=1e-3), sid
    noise = [(st["noiseB"], shaped[sid]["noiseB"]) for sid, st in iso.items() if st["noiseB"]]
    assert len(noise) == 1 and 0.9 < noise[0][1] / noise[0][0] < 1.1


def test_disk_offload_gives_the_same_refresh_and_leaves_no_files(snip_run, tmp_path):
    """--snip-offload disk (snapshot, A² and base gradients in files between uses): the
    refresh's stats.json and plan are bit-identical to the in-memory run's (``none`` on
    CPU), and so are the losses; the offload folder is gone after the refresh."""
    run_dir = tmp_path / "disk"
    launch([*FAST_ARGS, *SNIP, "--snip-offload", "disk", "--train-iters", "8", "--no-save",
            "--run-dir", str(run_dir)])
    for step in ("step_000002", "step_000005"):
        out, ref = run_dir / "snip" / step, snip_run / "snip" / step
        assert (json.loads((out / "stats.json").read_text()) ==
                json.loads((ref / "stats.json").read_text()))
        assert load_plan(str(out / "plan.json")).hash == load_plan(str(ref / "plan.json")).hash
    assert train_losses(run_dir) == train_losses(snip_run)
    assert not list(run_dir.glob("snip_offload_*"))


def test_plan_switches_at_the_apply_step(snip_run):
    records = [r for r in read_metrics(snip_run) if "loss" in r]
    hashes = [r["precision_plan"] for r in records]
    fp4 = [r["fp4_flop_frac"] for r in records]
    # safe plan (all FP8) for steps 1-4; refresh before step 3 applies before step 5
    assert len(set(hashes[:4])) == 1 and fp4[:4] == [0.0] * 4
    assert hashes[4] != hashes[3] and all(f >= 0.5 - 1e-9 for f in fp4[4:])
    assert [r.get("snip_refresh") for r in records][2] == 2
    # the timings outside step_time_s: reduction after step s+1, plan switch before s+lag+1
    assert [i for i, r in enumerate(records) if "snip_reduce_s" in r] == [2, 5]
    assert [i for i, r in enumerate(records) if "snip_apply_s" in r] == [4, 7]
    plan = load_plan(str(snip_run / "snip" / "step_000002" / "plan.json"))
    assert hashes[4] == plan.replace(stage_fp4_frac=[fp4[4]]).hash[:12]


def test_offline_tool_resolves_the_refresh_problem(snip_run, tmp_path):
    refresh = snip_run / "snip" / "step_000002"
    out = tmp_path / "plan.json"
    subprocess.run([sys.executable, str(REPO / "tools" / "snip_analyze.py"), "--problem",
                    str(refresh / "problem.json"), "--budget", "0.75", "--out", str(out)],
                   check=True, capture_output=True, cwd=REPO)
    solution = json.loads((tmp_path / "plan.solution.json").read_text())
    assert solution["fp4_fraction"] >= 0.75 - 1e-9
    plan, runs = load_plan(str(out)), load_plan(str(refresh / "plan.json"))
    assert (plan.method, plan.step, plan.budget) == ("snip", 2, 0.75)
    assert plan.objective == solution["objective"]
    assert sorted(plan.sites) == sorted(solution["choice"]) == sorted(runs.sites)


def _readme_commands(*starts: str) -> list[str]:
    """The README's commands (continuation lines joined, comments cut) beginning so."""
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    lines = [line.split("#")[0].split() for line in text.splitlines()]
    return [" ".join(next(w for w in lines if " ".join(w).startswith(s))) for s in starts]


def test_readme_snip_commands_chain(snip_run, tmp_path):
    """snip_analyze's --out is what --precision-plan and plot_precision read: run the README's
    three adjacent lines, in its order, on a real refresh's problem."""
    commands = _readme_commands("python tools/snip_analyze.py --problem",
                                "python pretrain_llama.py --precision-plan",
                                "python tools/plot_precision.py plan")
    problem = str(snip_run / "snip" / "step_000002" / "problem.json")
    for command in commands:
        argv = [problem if a.endswith("/problem.json") else a for a in command.split()[1:]]
        argv[0] = str(REPO / argv[0])
        if "pretrain_llama.py" in argv[0]:
            argv += [*FAST_ARGS, "--train-iters", "2", "--no-save", "--run-dir", "run"]
        proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, f"{command}:\n{proc.stderr[-3000:]}"
    assert (tmp_path / "plan.png").stat().st_size > 0
    plan = load_plan(str(tmp_path / "plan.json"))
    assert load_plan(str(tmp_path / "run" / "precision_plan.json")).sites == plan.sites


def test_resume_between_refresh_and_apply_reproduces_the_run(tmp_path):
    args = [*FAST_ARGS, *SNIP[:4], "--snip-start", "3", "--snip-interval", "0",
            "--snip-apply-lag", "3"]
    launch([*args, "--train-iters", "8", "--no-save", "--run-dir", str(tmp_path / "full")])
    ckpt = str(tmp_path / "ckpt")
    launch([*args, "--train-iters", "8", "--save", ckpt, "--exit-interval", "4",
            "--run-dir", str(tmp_path / "first")])
    launch([*args, "--train-iters", "8", "--load", ckpt, "--no-save",
            "--run-dir", str(tmp_path / "second")])
    full, second = train_losses(tmp_path / "full"), train_losses(tmp_path / "second")
    assert sorted(second) == [5, 6, 7, 8]
    assert [second[s] for s in range(5, 9)] == [full[s] for s in range(5, 9)]


@pytest.mark.parametrize("flags, message", [
    (["--snip-budget", "1.5"], "--snip-budget"),
    (["--snip-candidates", "fp8,nope"], "--snip-candidates"),
    (["--snip-apply-lag", "0"], "--snip-apply-lag"),
    (["--precision-plan", "plan.json"], "exclude each other"),
    (["--snip-probe", "sideways"], "--snip-probe"),
    (["--snip-sites-per-pass", "-1"], "--snip-sites-per-pass must be >= 0"),
])
def test_bad_snip_flags_are_one_line_errors(flags, message):
    proc = launch([*FAST_ARGS, "--precision", "snip", *flags, "--train-iters", "2",
                   "--no-save"], check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_dgrad_probe_needs_one_tensor_parallel_rank():
    from megatron_ext import extension as ext
    from megatron_ext.defaults import default_extensions
    from megatron_ext.errors import UsageError
    from megatron_ext.methods.snip.flags import config_from_args
    from megatron_ext.training.arguments import parse_args
    flags = ["--precision", "snip", "--snip-probe", "dgrad"]
    provider = ext.args_provider(default_extensions())
    assert config_from_args(parse_args("llama", flags, provider)).probe == "dgrad"
    args = parse_args("llama", [*flags, "--tensor-model-parallel-size", "2"], provider,
                      world_size=2)
    with pytest.raises(UsageError, match="--snip-probe dgrad needs"):
        config_from_args(args)


def test_sites_observed_in_groups_give_the_same_refresh(snip_run, tmp_path):
    """--snip-sites-per-pass 3: the 16 sites observed 3 at a time (6 groups of the three
    passes, 4 micro-batches a step), the others running the same GEMMs and noise unobserved.
    Every statistic is bit-identical to one set of passes, but the stochastic-rounding dy
    candidate's, whose draws come in another order (one site's can move 2x between draws;
    summed over the sites, within 1.5x), and training goes on with the same losses until
    the refresh's plan applies."""
    run_dir = tmp_path / "groups"
    launch([*FAST_ARGS, *SNIP, "--snip-sites-per-pass", "3", "--train-iters", "4", "--no-save",
            "--run-dir", str(run_dir)])
    ref, got = _refresh_stats(snip_run), _refresh_stats(run_dir)
    assert got.keys() == ref.keys()
    drawn = {}  # key -> (reference, grouped) sums over the sites
    for sid, stats in ref.items():
        for key, value in stats.items():
            if not isinstance(value, dict):
                assert got[sid][key] == value, (sid, key)
                continue
            for fmt, v in value.items():
                if "+sr" in fmt:
                    old, new = drawn.get(key, (0.0, 0.0))
                    drawn[key] = (old + v, new + got[sid][key][fmt])
                else:
                    assert got[sid][key][fmt] == v, (sid, key, fmt)
    assert sorted(drawn) == ["Bdy", "Bdyw", "Gdy", "WGdy"]  # the SR dy candidate's
    for key, (old, new) in drawn.items():
        assert 1 / 1.5 < new / old < 1.5, key
    grouped, whole = train_losses(run_dir), train_losses(snip_run)
    assert [grouped[i] for i in (1, 2, 3)] == [whole[i] for i in (1, 2, 3)]
