"""The GPU shadow (``benchmarks/gpu_shadow.py``, through ``host_syncs.py``) under torchrun:
the four methods composed at TP=2 x DP=2 with the distributed optimizer and at PP=2 x DP=2,
SNIP's refresh kept on the host as on a GPU (``--snip-offload host``), place every tensor
as a GPU run would without an op that mixes host and device tensors (a crash there only:
the script exits 1 and lists them), and rank 0 waits on the host a handful of times per
step, not per site or parameter."""

import json

import pytest

from pretrain_runner import launch

TRAIN = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length",
         "64", "--lr-warmup-iters", "1", "--eval-iters", "0", "--train-iters", "5",
         "--log-interval", "100", "--no-save", "--precision", "snip", "--snip-start", "3",
         "--snip-interval", "0", "--snip-offload", "host", "--gnmr", "--optimizer",
         "stquant-adamw", "--gaussws", "od"]
LAYOUTS = {
    "tp2dp2-distopt": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
    "pp2dp2": ["--pipeline-model-parallel-size", "2"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_composed_methods_place_tensors_as_on_a_gpu(tmp_path, layout):
    out = tmp_path / "syncs.json"
    proc = launch(["--json", str(out), "--", *TRAIN, *LAYOUTS[layout], "--run-dir",
                   str(tmp_path / "run")], nproc=4, script="benchmarks/host_syncs.py",
                  timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {s["step"]: s for s in json.loads(out.read_text())}
    assert sorted(steps) == list(range(1, 6))
    assert not any(s["mixed"] for s in steps.values())
    for step in (2, 3, 5):  # step 4 is the refresh, step 5 applies its plan and is logged
        assert steps[step]["count"] <= 12 and steps[step]["uploads"] <= 4, steps[step]
    assert steps[4]["count"] <= 40 and steps[4]["uploads"] <= 8, steps[4]
