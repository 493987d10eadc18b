"""benchmarks/stquant_step.py's ``run(device)`` (the rows the GPU check prints), on CPU at a
tiny shape: a row per optimizer, and the check rows (on CPU the compiled kernel against the
torch path: codes bit for bit, the parameter within the ulp tolerance)."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).parents[4]
_SPEC = importlib.util.spec_from_file_location("_stquant_step", REPO / "benchmarks" / "stquant_step.py")
BENCH = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(BENCH)


def test_llama_shapes_count_tinyllama_parameters():
    shapes = BENCH.llama_shapes(22, 2048, 5632, 32000)
    assert sum(BENCH.torch.Size(s).numel() for s in shapes) == 1_100_048_384  # TinyLlama-1.1B


def test_run_rows_on_cpu():
    rows = BENCH.run("cpu", layers=1, hidden=64, ffn=128, vocab=64, names=("adamw", "stquant-4"),
                     iters=1, check_numel=4096)
    steps, checks = rows[:2], rows[2:]
    assert [r["operation"] for r in steps] == ["optimizer step adamw", "optimizer step stquant-4"]
    assert steps[0]["x_adamw"] == 1.0 and steps[1]["ms"] > 0
    assert len(checks) == 5
    assert all(r["codes_bit_identical"] and r["param_within_ulp_tolerance"] for r in checks)
