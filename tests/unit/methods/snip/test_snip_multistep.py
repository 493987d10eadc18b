"""The multi-step ground truth (``benchmarks/snip_multistep.py``, ``multistep.py``), small: its
unquantized reference trajectory is the uninterrupted continuation of the checkpoint, each
option's divergence is there and grows, and the growth exponent of known power laws."""

import json
import math
import subprocess
import sys

from megatron_ext.methods.snip.multistep import growth_exponent
from pretrain_runner import REPO, launch, read_metrics

SMALL = ["--mock-data", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--num-layers", "2", "--lr-warmup-iters", "1"]
REGIME = ["--model", "tiny", "--train-iters", "200", "--lr", "1e-3", "--min-lr", "1e-4"]


def test_growth_exponent_of_power_laws():
    steps = [1, 10, 50]
    assert math.isclose(growth_exponent(steps, [3e-5 * n for n in steps]), 1.0)
    assert math.isclose(growth_exponent(steps, [-2e-4 * n ** 0.5 for n in steps]), 0.5)
    assert math.isnan(growth_exponent(steps, [1.0, 0.0, 2.0]))


def test_reference_is_the_uninterrupted_run_and_options_diverge(tmp_path):
    out = tmp_path / "ms.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "snip_multistep.py"), "--run-dir",
         str(tmp_path / "run"), "--load-step", "2", "--steps", "1,2", "--sites", "L0.fc1,L1.qkv",
         "--eval-batches", "1", "--weights", "1,2", f"--model-args={' '.join(SMALL)}",
         "--json", str(out)], capture_output=True, text=True, cwd=REPO, timeout=900,
        check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    truth = json.loads(out.read_text())["truth"]
    launch([*REGIME, *SMALL, "--load", str(tmp_path / "run" / "checkpoints"), "--no-save",
            "--exit-interval", "4", "--eval-interval", "1", "--eval-iters", "1",
            "--log-interval", "1", "--run-dir", str(tmp_path / "cont")])
    val = {r["step"]: r["val_loss"] for r in read_metrics(tmp_path / "cont") if "val_loss" in r}
    assert truth["ref_loss"] == [val[3], val[4]]  # same data, schedule and arithmetic
    assert truth["options"] == ["dy", "xw"] and truth["sites"] == ["L0.fc1", "L1.qkv"]
    for option in truth["dW"]:
        for one, two in option:
            assert 0 < one < two
    assert all(v > 0 for row in truth["est_dW"] for v in row)
    # ΔL of x, w in FP8 (the dy option) is far below that of x, w in FP4
    assert all(0 < a < b / 4 for a, b in zip(*truth["est_dL"]))
    # --reestimate: the paper's reach gives this run's estimate again; reaching every site
    # adds the sites above each one (both have some: L1.proj, fc1, fc2 are above L1.qkv)
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "snip_multistep.py"), "--run-dir",
         str(tmp_path / "run"), "--load-step", "2", f"--model-args={' '.join(SMALL)}",
         "--reestimate", str(out)], capture_output=True, text=True, cwd=REPO, timeout=900,
        check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = {" ".join(line.split()[:2]): [float(v) for v in line.split(":")[-1].split()]
              for line in proc.stdout.splitlines() if "measured / est." in line}
    for i, name in enumerate(truth["options"]):
        paper = [dw[0] / est for dw, est in zip(truth["dW"][i], truth["est_dW"][i])]
        assert ratios[f"{name} below"] == [round(v, 2) for v in paper]
        assert all(a < b for a, b in zip(ratios[f"{name} all"], ratios[f"{name} below"]))
