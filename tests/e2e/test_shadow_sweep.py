"""benchmarks/shadow_sweep.py: one config end to end (its JSON and table), and a failing row
(an op that would mix devices) marked in the table and in the exit status."""

import json
import subprocess
import sys

from pretrain_runner import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import shadow_sweep  # noqa: E402


def test_one_config_writes_its_row(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "shadow_sweep.py"),
                           "--out", str(tmp_path), "--configs", "uniform:fp8",
                           "--cpu-side-only"], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row, = json.loads((tmp_path / "shadow_sweep.json").read_text())
    assert row["config"] == "uniform:fp8" and row["side"] == "CPU" and row["rc"] == 0
    # reads: loss, flag, grad norm; no upload in a normal step (megatron's local l2-norm
    # fallback made the norm on the host and uploaded it: the foreach norm keeps it on device)
    assert row["mixed"] == [] and row["reads"] == 3 and row["uploads"] == 0
    assert row["launches"] > 100  # their own count: test_host_syncs.py
    assert "| uniform:fp8 | CPU | 1 | ok | 3 / 0 |" in (tmp_path / "shadow_sweep.md").read_text()


def test_a_mixed_op_fails_the_row():
    rows = [{"config": "x", "side": "GPU", "ranks": 2, "rc": 1,
             "mixed": ["step 3: 1 x a.py:1 f: aten::stack of device (), host ()"]},
            {"config": "y", "side": "CPU", "ranks": 1, "rc": 2, "mixed": [], "error": "boom"}]
    text = shadow_sweep.table(rows)
    assert "| x | GPU | 2 | **1 mixed** |" in text and "| y | CPU | 1 | **failed (2)** |" in text
