"""benchmarks/quantize.py's ``run(device)`` (the rows the GPU check prints), at a tiny size
on CPU: one row per format and dtype, checked against the torch reference."""

import importlib.util
from pathlib import Path

import torch

REPO = Path(__file__).parents[3]
_SPEC = importlib.util.spec_from_file_location("_quantize_bench", REPO / "benchmarks" / "quantize.py")
BENCH = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(BENCH)


def test_run_rows_on_cpu():
    rows = BENCH.run("cpu", size=(32, 256), formats=["int8@row", "nvfp4", "mxfp4+sr"], iters=1)
    assert [(r["format"], r["dtype"]) for r in rows] == [
        (f, d) for d in ("float32", "bfloat16") for f in ("int8@row", "nvfp4", "mxfp4+sr")
    ]
    for r in rows:
        assert r["bit_identical"] is (None if r["format"].endswith("+sr") else True)
        assert r["ms"] > 0 and r["x_clone"] > 0
        assert r["host_ms"] == r["ms"]  # on CPU both are the wall time
        bytes_in = 32 * 256 * (4 if r["dtype"] == "float32" else 2)
        assert abs(r["gb_per_s"] * r["ms"] * 1e6 - bytes_in) < 1e-3 * bytes_in


def test_run_stops_at_its_budget():
    rows = BENCH.run("cpu", size=(8, 128), formats=["fp8_e4m3"], dtypes=[torch.float32],
                     budget_s=-1.0)
    assert rows == [{"format": "fp8_e4m3", "dtype": "float32", "device": "cpu", "skipped": True}]
