"""tools/compare_precision.py end to end: a 2-run x 2-seed grid of 3-step tiny-Llama runs.

One grid (module scope, ``--jobs 2``) is trained once; the tests read its outputs, compare
the statistics with a hand computation from the runs' own metrics.jsonl (numpy, float64),
re-run it to check that finished jobs are reused and a broken one is trained again, and
check that bad input and failed jobs leave no results file.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_ext.compare.cli import main
from megatron_ext.compare.figures import tradeoff_points
from pretrain_runner import FAST_ARGS, REPO

TOOL = REPO / "tools" / "compare_precision.py"
SEEDS = (1, 2)
RUNS = {"fp32": "", "fp4": "--precision uniform:fp4"}
BASE = [*FAST_ARGS, "--eval-iters", "1", "--train-iters", "3"]  # later --eval-iters wins


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def write_config(path: Path, **changes) -> Path:
    config = {"base_flags": BASE, "seeds": list(SEEDS), "reference": "fp32", "runs": RUNS,
              **changes}
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """(config path, out dir, the tool's completed process) of the trained grid."""
    root = tmp_path_factory.mktemp("compare")
    config = write_config(root / "grid.json")
    proc = tool("--config", str(config), "--out", str(root / "out"), "--jobs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return config, root / "out", proc


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().split("\n")
            if line]


def final_val_loss(run_dir: Path) -> float:
    val = [r for r in records(run_dir) if "val_loss" in r]
    assert max(r["step"] for r in val) == 3
    return [r for r in val if r["step"] == 3][-1]["val_loss"]


def test_results_exist(grid):
    _, out, proc = grid
    results = json.loads((out / "results.json").read_text())
    assert list(results["runs"]) == list(RUNS)
    markdown = (out / "results.md").read_text()
    assert "`fp4`" in markdown and "± " in markdown and "img/gaps.png" in markdown
    for png in ("loss.png", "loss_end.png", "gaps.png", "tradeoff.png"):
        assert (out / "img" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / "img" / png).stat().st_size > 5000
    assert "[4/4]" in proc.stderr and "ETA" in proc.stderr
    points = {p[0]: p[1:4] for p in tradeoff_points(results)}  # the quality-vs-time figure's
    ref = results["grid"]["reference"]
    assert points[ref][1:] == (0.0, None)
    for name, run in results["runs"].items():
        assert points[name][0] == run["gemm_time_vs_bf16"]
        if name != ref:  # the paired difference, recomputed from the per-seed losses
            seeds = run["seeds"]
            diffs = [seeds[s]["val_loss"] - results["runs"][ref]["seeds"][s]["val_loss"]
                     for s in seeds]
            assert points[name][1] == pytest.approx(sum(diffs) / len(diffs), abs=1e-12)
    for run in RUNS:
        for seed in SEEDS:
            run_dir = out / "runs" / run / f"seed_{seed}"
            argv = json.loads((run_dir / "compare_job.json").read_text())["argv"]
            assert argv[-5:] == ["--seed", str(seed), "--run-dir", str(run_dir), "--no-save"]


def test_statistics_equal_hand_computation(grid):
    _, out, _ = grid
    results = json.loads((out / "results.json").read_text())
    loss = {run: np.array([final_val_loss(out / "runs" / run / f"seed_{s}") for s in SEEDS],
                          dtype=np.float64) for run in RUNS}
    for run, values in loss.items():
        got = results["runs"][run]
        assert [got["seeds"][str(s)]["val_loss"] for s in SEEDS] == list(values)
        assert got["val_loss"]["mean"] == pytest.approx(values.mean(), rel=1e-12)
        assert got["val_loss"]["se"] == pytest.approx(values.std(ddof=1) / np.sqrt(2),
                                                      rel=1e-9)
    diff = loss["fp4"] - loss["fp32"]
    paired = results["runs"]["fp4"]["vs_reference"]
    assert [paired["diffs"][str(s)] for s in SEEDS] == pytest.approx(list(diff), abs=1e-15)
    assert paired["mean"] == pytest.approx(diff.mean(), rel=1e-9)
    assert paired["se"] == pytest.approx(diff.std(ddof=1) / np.sqrt(2), rel=1e-9)
    assert paired["rel_pct"] == pytest.approx(100 * diff.mean() / loss["fp32"].mean(), rel=1e-9)
    assert results["runs"]["fp32"]["vs_reference"] is None
    order = sorted(RUNS, key=lambda r: loss[r].mean())
    assert {r: results["runs"][r]["rank"] for r in RUNS} == {order[0]: 1, order[1]: 2}
    assert results["groups"][0]["ranking"] == order
    # uniform FP4: every linear GEMM in FP4, a quarter of the BF16 GEMM time; FP32: none
    assert results["runs"]["fp4"]["fp4_flop_frac"] == 1.0
    assert results["runs"]["fp4"]["gemm_time_saving"] == pytest.approx(0.75)
    assert results["runs"]["fp32"]["fp4_flop_frac"] == 0.0
    assert results["runs"]["fp32"]["gemm_time_saving"] == 0.0
    markdown = (out / "results.md").read_text()
    for run in RUNS:  # peak memory: the largest logged mem_gib, per seed and over the seeds
        peaks = [max(r["mem_gib"] for r in records(out / "runs" / run / f"seed_{s}")
                     if "loss" in r) for s in SEEDS]
        got = results["runs"][run]
        assert [got["seeds"][str(s)]["mem_gib"] for s in SEEDS] == peaks
        assert got["mem_gib"] == max(peaks) > 0.1
        assert f"| {max(peaks):.2f} |" in markdown


def test_dry_run_lists_jobs_and_writes_nothing(grid, tmp_path, capsys):
    config, out, _ = grid
    assert main(["--config", str(config), "--out", str(out), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "4 jobs:"
    assert all(line.startswith("reuse ") for line in lines[1:])  # all finished
    fresh = tmp_path / "fresh"
    assert main(["--config", str(config), "--out", str(fresh), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[:2] for line in lines] == [
        ["run", f"{r}/seed_{s}:"] for s in SEEDS for r in RUNS]
    assert f"--run-dir {fresh}/runs/fp4/seed_2 --no-save" in lines[-1]
    assert not fresh.exists()


def test_a_run_from_another_checkout_is_reused(grid, capsys):
    """The mark names the script where it lay; another checkout of it is the same command."""
    config, out, _ = grid
    mark_path = out / "runs" / "fp4" / "seed_1" / "compare_job.json"
    mark = json.loads(mark_path.read_text())
    moved = {**mark, "argv": ["/elsewhere/megatron_ext/pretrain_llama.py", *mark["argv"][1:]]}
    mark_path.write_text(json.dumps(moved))
    other = {**mark, "argv": [mark["argv"][0], *mark["argv"][1:-1], "--bf16"]}
    try:
        assert main(["--config", str(config), "--out", str(out), "--dry-run"]) == 0
        assert all(line.startswith("reuse ") for line in capsys.readouterr().out.splitlines()[1:])
        mark_path.write_text(json.dumps(other))  # other flags: not this job
        assert main(["--config", str(config), "--out", str(out), "--dry-run"]) == 0
        assert "rerun fp4/seed_1:" in capsys.readouterr().out
    finally:
        mark_path.write_text(json.dumps(mark))


@pytest.mark.parametrize("changes, message", [
    ({"sedes": [1]}, "unknown key 'sedes'"),
    ({"runs": {"fp32": None}}, "runs.fp32: flags missing"),
    ({"seeds": "1,x"}, "not a comma-separated list of integers"),
    ({"seeds": [1, 1]}, "repeats a seed"),
    ({"reference": "bf16"}, "reference 'bf16' is not one of the runs"),
    ({"runs": {"a": "--seed 3"}, "reference": None}, "--seed is set by the tool"),
    ({"runs": {"a": "--eval-iters=0"}, "reference": None},
     "run a: --eval-iters 0 leaves no validation loss, the score compared"),
])
def test_bad_config_is_one_line_exit_2(tmp_path, capsys, changes, message):
    config = write_config(tmp_path / "grid.json", **changes)
    assert main(["--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_failed_job_writes_no_results(tmp_path, capsys):
    """A job that exits 1 (a stand-in script: pretrain's own failures cost seconds)."""
    entry = tmp_path / "fails.py"
    entry.write_text("import sys\nif '--check-flags' in sys.argv: sys.exit(0)  # flags pass\n"
                     "print('no such flag', sys.argv[1:])\nsys.exit(1)\n")
    out = tmp_path / "out"
    (out / "img").mkdir(parents=True)
    for stale in ("results.json", "results.md", "img/gaps.png"):  # an earlier invocation's
        (out / stale).write_text("stale")
    assert main(["--out", str(out), "--seeds", "1,2", "--entry", str(entry), "--run",
                 "bad=--no-such-flag 1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: 2 of 2 jobs failed, no results written: bad/seed_1: "
                              "exit status 1") and "bad/seed_2" in err[-1]
    assert [line for line in err if line.startswith("error")] == [err[-1]]
    assert not any((out / f).exists() for f in ("results.json", "results.md", "img/gaps.png"))
    assert "--no-such-flag" in (out / "runs" / "bad" / "seed_1" / "train.log").read_text()


def test_a_typo_in_one_run_is_refused_before_any_run_trains(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--out", str(out), "--seeds", "1,2", f"--base-flags={' '.join(BASE)}",
                 "--run", "good=--precision uniform:fp4", "--run",
                 "typo=--precison uniform:fp4", "--run", "nan=--lr nan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: run typo: unrecognized arguments: --precison uniform:fp4 "
                          "(and 1 more run(s))"), err
    assert not out.exists()  # nothing trained, nothing written


def test_rerun_reuses_finished_and_retrains_broken(grid):
    """Last in this file: it changes the shared grid (one run is broken and re-trained)."""
    config, out, _ = grid
    before = json.loads((out / "results.json").read_text())
    marks = {(r, s): out / "runs" / r / f"seed_{s}" / "compare_job.json"
             for r in RUNS for s in SEEDS}
    mtimes = {key: path.stat().st_mtime_ns for key, path in marks.items()}
    broken = out / "runs" / "fp4" / "seed_2" / "metrics.jsonl"
    broken.write_text("".join(broken.read_text().splitlines(keepends=True)[:-1]))  # no val
    proc = tool("--config", str(config), "--out", str(out), "--jobs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 finished before (reused), 1 to run" in proc.stderr
    assert "[1/1] fp4/seed_2: val loss" in proc.stderr
    for key, path in marks.items():
        assert (path.stat().st_mtime_ns == mtimes[key]) == (key != ("fp4", 2)), key
    after = json.loads((out / "results.json").read_text())
    assert after["runs"]["fp4"]["seeds"]["2"]["val_loss"] == pytest.approx(
        before["runs"]["fp4"]["seeds"]["2"]["val_loss"], abs=1e-5)  # deterministic re-run
