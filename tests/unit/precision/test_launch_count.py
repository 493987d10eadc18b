"""``benchmarks/launch_count.py``: the launches of one linear's real FP8 GEMMs per micro-batch,
counted on CPU with the quantizers' GPU side (Triton's interpreter; every op and Triton run a
launch). Per-tensor E4M3 (``uniform:fp8_e4m3``), the fast FP8 recipe, takes the handful
that remain without fusing the amax into the operand's producer: per GEMM one amax, one cast
(writing the transpose the other GEMM reads) and ``_scaled_mm``; its weight two launches a
step; wgrad ``_scaled_mm`` alone."""

import json
import os
import subprocess
import sys

from pretrain_runner import REPO

MICRO_BATCHES = 2
OLD = {"fprop": 4, "dgrad": 5, "wgrad": 3, "total": 12}
"""The same count at commit 4aa4122, before the weights' transposes were cached and the
casts wrote both layouts: fprop 3 + its weight's 2 once a step, dgrad 5 (dy's amax and cast,
w.T's amax and cast, the GEMM), wgrad 3 (two transposed copies, the GEMM)."""


def test_per_tensor_fp8_takes_a_handful_of_launches_per_gemm(tmp_path):
    out = tmp_path / "launches.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "launch_count.py"),
                           "--formats", "fp8_e4m3", "--micro-batches", str(MICRO_BATCHES),
                           "--json", str(out)], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| fp8_e4m3, cached |" in proc.stdout
    rows = json.loads(out.read_text())
    cached, fresh = rows["fp8_e4m3, cached"], rows["fp8_e4m3, no cache"]
    # x / dy: amax, cast (+ transpose); then the GEMM; wgrad reads both kept transposes
    assert (cached["fprop"], cached["dgrad"], cached["wgrad"]) == (3, 3, 1)
    assert cached["weights"] * MICRO_BATCHES == 2  # amax, cast (+ transpose), once a step
    assert fresh["weights"] == 4  # without the cache: fprop's and dgrad's, each micro-batch
    assert cached["other"] == 0
    assert cached["total"] <= 8 < OLD["total"]
    assert cached["fprop"] + cached["weights"] == OLD["fprop"]  # dgrad's q(w) comes with it
    assert cached["dgrad"] < OLD["dgrad"] and cached["wgrad"] < OLD["wgrad"]
