"""``benchmarks/gpu_check.py`` on a machine without a GPU: ``--help`` explains itself, a run
says in one line that it needs a GPU (exit 2), and its markdown report renders results."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_help_lists_the_sections():
    proc = _run("--help")
    assert proc.returncode == 0
    for word in ("--sections", "--train-configs", "tokens/s", "bit-identical", "wheels"):
        assert word in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    proc = _run("--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: benchmarks/gpu_check.py needs a CUDA GPU; none is visible"]
    assert not (tmp_path / "out").exists()


def test_the_report_renders_every_section():
    sys.path.insert(0, str(REPO))
    from benchmarks.gpu_sections import markdown

    results = {"env": {"gpu": "H100"},
               "train": {"rows": [{"config": "bf16", "tokens/s": 100, "log": ["x"]},
                                  {"config": "snip", "error": "CUDA out of memory"},
                                  {"config": "pgq", "tokens/s": 50, "profile s": 2.0}]},
               "gemm": {"error": "RuntimeError: boom"}, "main": {"returncode": 0}}
    text = markdown(results)
    assert "| config | tokens/s | profile s |" in text and "| bf16 | 100 |  |" in text
    assert "| pgq | 50 | 2.0 |" in text  # a column only a later row has
    assert "error in snip: CUDA out of memory" in text
    assert "gemm: RuntimeError: boom" in text and "formats: not run" in text


def test_the_new_sections_call_the_benchmarks_run(monkeypatch, tmp_path):
    """``formats`` and ``stquant`` report what ``benchmarks/quantize.py`` / ``stquant_step.py``
    measure (their ``run`` is tested on CPU with those scripts); the snip row's refresh ratio
    comes from ``snip_memory.refresh_vs_step``."""
    sys.path.insert(0, str(REPO))
    import benchmarks.stquant_step
    from benchmarks import gpu_sections

    monkeypatch.setattr(benchmarks.stquant_step, "run",
                        lambda device: [{"operation": "optimizer step adamw", "ms": 1.23456}])
    assert gpu_sections.stquant(None, tmp_path) == {
        "rows": [{"operation": "optimizer step adamw", "ms": 1.235}]}
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 5.0, "mem_gib": 2.0}\n'
        '{"step": 2, "loss": 5.0, "mem_gib": 2.0, "snip_refresh": 1}\n')
    assert gpu_sections._refresh_ratio(run) == 1.0
    assert "metrics.jsonl" in gpu_sections._refresh_ratio(tmp_path)


def test_per_tensor_to_fp8s_two_passes_are_timed_apart(monkeypatch):
    sys.path.insert(0, str(REPO))
    from benchmarks import gpu_sections
    from megatron_ext.formats import triton_fp8

    seconds = iter([2e-3, 1e-3])
    monkeypatch.setattr(gpu_sections, "_time", lambda fn: (fn(), next(seconds))[1])
    monkeypatch.setattr(triton_fp8, "scale_and_cast", lambda *args: None)  # a GPU kernel
    row = gpu_sections._two_passes(torch.randn(8, 8).bfloat16(), clone_s=1e-3)
    assert row == {"format": "to_fp8 fp8_e4m3, each pass", "dtype": "bfloat16",
                   "amax x clone": 2.0, "cast x clone": 1.0}


def test_the_pair_row_holds_both_layouts_to_the_cpu_path(monkeypatch):
    """``to_fp8_pair``'s row: both operands against ``to_fp8`` along either axis (here the
    CPU path on both sides), and a pair without the transpose is caught."""
    sys.path.insert(0, str(REPO))
    from benchmarks import gpu_sections
    from megatron_ext.formats import fp8

    monkeypatch.setattr(gpu_sections, "_time", lambda fn: (fn(), 3e-3)[1])
    x = torch.randn(32, 48).bfloat16()
    assert gpu_sections._pair(x, x, clone_s=1e-3) == {
        "format": "to_fp8_pair fp8_e4m3 (both layouts)", "dtype": "bfloat16",
        "bit_identical": True, "x_clone": 3.0}
    monkeypatch.setattr(fp8, "to_fp8_pair", lambda t, fmt: (fp8.to_fp8(t, fmt),) * 2)
    assert gpu_sections._pair(x, x, clone_s=1e-3)["bit_identical"] is False


def test_pytest_outcomes_name_the_failures_of_a_cut_off_run():
    sys.path.insert(0, str(REPO))
    from benchmarks.gpu_sections import pytest_outcomes

    text = ("[gw0] [ 50%] PASSED tests/unit/a.py::test_one\n"
            "[gw1] [ 62%] FAILED tests/unit/b.py::test_two\n"
            "[gw0] [ 70%] ERROR tests/unit/c.py::test_three\n"
            "[gw1] [ 80%] PASSED tests/unit/b.py::test_four\n")
    got = pytest_outcomes(text)
    assert got["passed"] == 2
    assert got["failed"] == ["[gw1] [ 62%] FAILED tests/unit/b.py::test_two",
                             "[gw0] [ 70%] ERROR tests/unit/c.py::test_three"]


def test_profile_cost_per_batch_and_its_last_batch(tmp_path):
    sys.path.insert(0, str(REPO))
    from benchmarks import gpu_sections

    (tmp_path / "args.json").write_text(json.dumps({"pgq_profile_steps": 2}))
    records = [{"step": 1, "pgq_profile_s": 2.0, "pgq_profile_last_batch_s": 0.5}, {"step": 2}]
    timed = [{"step_time_s": t} for t in (0.2, 0.25, 0.3)]
    assert gpu_sections._profile_cost(tmp_path, records, timed) == {
        "profile s": 2.0, "profile batch x step": 4.0, "last profile batch x step": 2.0}
    assert gpu_sections._profile_cost(tmp_path, [{"step": 1}], timed) == {}


def test_the_syncs_section_runs_host_syncs_and_counts_per_step(tmp_path):
    """On CPU the section runs as on a GPU, without the CUDA column: uniform:fp8 reads the
    host 3 times a step (loss, non-finite flag, gradient norm)."""
    sys.path.insert(0, str(REPO))
    from benchmarks import gpu_syncs

    result = gpu_syncs.syncs(argparse.Namespace(sync_configs=["uniform:fp8"]), tmp_path)
    [row] = result["rows"]  # no launch-cost rows without a GPU
    assert row.pop("launches / step") > 100  # the launches' own count: test_host_syncs.py
    assert row == {"config": "uniform:fp8", "reads / step": 3, "most reads": 3}
    on_gpu = [{"step": 1, "logged": True, "count": 9, "cuda_syncs": 12, "launches": 900,
               "cuda_sync_sources": {"a.py:1 f": 12}},
              {"step": 2, "logged": False, "count": 3, "cuda_syncs": 4, "launches": 700,
               "cuda_sync_sources": {"a.py:1 f": 3, "b.py:2 g": 1}},
              {"step": 3, "logged": False, "count": 5, "cuda_syncs": 6, "launches": 800,
               "cuda_sync_sources": {"a.py:1 f": 6}}]
    assert gpu_syncs.sync_counts(on_gpu) == {
        "reads / step": 4, "most reads": 9, "launches / step": 750, "CUDA syncs / step": 5,
        "most CUDA syncs": 12, "CUDA syncs by source / step": {"a.py:1 f": 4.5, "b.py:2 g": 0.5}}


def test_a_row_flag_the_shape_names_replaces_its_value():
    sys.path.insert(0, str(REPO))
    from benchmarks.gpu_check import TRAIN_CONFIGS, TRAIN_SHAPE, row_flags

    flags = row_flags(TRAIN_CONFIGS["gaussws 1 sequence"])
    assert len(flags) == len(TRAIN_SHAPE) + 2 and flags[-2:] == ["--gaussws", "od"]
    for name in ("--micro-batch-size", "--global-batch-size"):
        assert flags.count(name) == 1 and flags[flags.index(name) + 1] == "1"
    assert row_flags(TRAIN_CONFIGS["stquant"]) == [*TRAIN_SHAPE, "--optimizer", "stquant-adamw"]


def test_issue_22s_targets_from_two_calls_results(tmp_path):
    """Two calls' results merged (training rows by config): each target's verdict from the
    numbers, a missing row "not run", a section's error string "error"; the CLI prints the
    table and a bad file is one line and exit 2."""
    sys.path.insert(0, str(REPO))
    from benchmarks import gpu_targets

    first = {"train": {"rows": [
        {"config": "bf16", "tokens/s": 40000},
        {"config": "snip", "tokens/s": 25000, "refresh x step memory": 1.02},
        {"config": "pgq", "tokens/s": 20000, "profile batch x step": 2.5,
         "last profile batch x step": 0.9},
        {"config": "pgq plan", "tokens/s": 20500}]},
        "formats": {"rows": [{"format": "int8@row", "dtype": "bfloat16", "x_clone": 2.1},
                             {"format": "fp8_e4m3", "dtype": "bfloat16", "x_clone": 3.4}]}}
    second = {"train": {"rows": [{"config": "snip plan", "tokens/s": 24000}]},
              "stquant": {"error": "RuntimeError: boom"}}
    rows = {r["target"]: r for r in gpu_targets.targets(gpu_targets.merged([first, second]))}
    verdicts = {name: r["verdict"] for name, r in rows.items()}
    assert verdicts == {
        "SNIP refresh peak memory x a normal step's": "met",
        "SNIP step time x BF16's": "NOT met",  # 40000 / 25000 = 1.6
        "SNIP step time x its own plan's (--precision-plan)": "met",  # 0.96
        "PGQ step time x its recipe's (--precision-plan)": "met",  # 1.02
        "PGQ profile per batch x a step": "NOT met",
        "PGQ profile's last batch x a step (no first-use Triton compilation)": "met",
        "STQuant optimizer step x fused AdamW": "not run",
        "every format's GPU path x clone()": "NOT met"}
    assert rows["SNIP step time x BF16's"]["measured"] == "1.6x"
    assert rows["every format's GPU path x clone()"]["measured"].endswith(
        "; over: fp8_e4m3 bfloat16 3.4x")
    from benchmarks.gpu_sections import markdown
    assert "### issue 22 targets" in markdown(first)  # gpu_check.md starts with them
    (tmp_path / "a.json").write_text(json.dumps(first))
    (tmp_path / "b.json").write_text(json.dumps(second))
    script = REPO / "benchmarks" / "gpu_targets.py"
    proc = subprocess.run([sys.executable, script, tmp_path / "a.json", tmp_path / "b.json"],
                          capture_output=True, text=True, check=True)
    row = "| SNIP step time x its own plan's (--precision-plan) | 0.96x | <= 1.15 | met |"
    assert row in proc.stdout
    bad = subprocess.run([sys.executable, script, tmp_path / "missing.json"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1
    assert bad.stderr.startswith("error:")
