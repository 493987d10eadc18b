"""``benchmarks/tensor_traffic.py`` on a tiny model: the profile's float64 torch sums move
several times the bytes of the Triton pass that replaces them, and the counts are sane."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
TINY = ["--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "176",
        "--num-attention-heads", "2", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data", "--bf16"]


def _traffic(sums: str) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "benchmarks/tensor_traffic.py", "--sums", sums, *TINY],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    out = {}
    for key in ("profile batch", "step"):
        gb, ops, gflop = re.search(rf"{key}: ([\d.]+) GB, (\d+) ops, ([\d.]+) GFLOP",
                                   proc.stdout).groups()
        out[key] = float(gb)
        out[key + " gflop"] = float(gflop)
    return out


def test_kernel_sums_move_fewer_bytes_than_the_float64_torch_sums():
    reference, kernel = _traffic("reference"), _traffic("kernel")
    assert reference["step"] == kernel["step"] > 0  # the step does not take error sums
    assert reference["profile batch"] > 2.5 * kernel["profile batch"]
    # a profiled batch runs the same GEMMs as a step: forward and backward, unquantized
    assert kernel["profile batch gflop"] == kernel["step gflop"] > 0
