"""benchmarks/host_syncs.py: its counter against hand-made reads (a device tensor's ``item``
and ``.cpu()`` count, a host tensor's do not), and the composed run (SNIP + GNMR + STQuant)
reading the host a handful of times per step, not per site: a refresh read 879 times on
this model when each statistic was a ``float()``, the formats' amax check 144 per step."""

import json
import subprocess
import sys

import torch

from pretrain_runner import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import host_syncs  # noqa: E402

TRAIN = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length",
         "64", "--lr-warmup-iters", "1", "--eval-iters", "0", "--train-iters", "6",
         "--log-interval", "100", "--no-save", "--precision", "snip", "--snip-start", "3",
         "--snip-interval", "0", "--gnmr", "--optimizer", "stquant-adamw"]


def test_counts_reads_of_device_tensors_only():
    counter = host_syncs.SyncCounter()
    weight, step = torch.randn(4, 4), torch.tensor(3.0)
    host_syncs.mark([weight])
    with counter:
        loss = (weight * 2).sum()
        float(loss)  # a device value read: 1
        if (weight > 0).any():  # bool of a device tensor: 2
            pass
        copy = weight.cpu()  # a copy to the host: 3
        copy.tolist()  # a host tensor: free
        step.item()  # a step count on the host: free
        weight[weight > 0]  # a boolean mask: 4
        torch.zeros(3).sum().item()  # made on the host: free
    assert sum(counter.reads[0].values()) == 4
    assert not host_syncs.on_device(copy) and host_syncs.on_device(loss)


def test_composed_run_reads_the_host_per_step_not_per_site(tmp_path):
    out = tmp_path / "syncs.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_syncs.py"), "--json",
                           str(out), "--", *TRAIN, "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {s["step"]: s for s in json.loads(out.read_text())}
    assert sorted(steps) == list(range(1, 7))
    # loss, the all-reduced non-finite flag, grad norm; GNMR's reduce (2); STQuant's widths
    # (1, steps < 5); the plan check after SNIP's switch at step 5 (3); step 1 is logged
    for step in (2, 3, 5):
        assert steps[step]["count"] <= 10, steps[step]
    assert steps[4]["count"] <= 25, steps[4]  # the refresh: 18 (a float() per statistic,
    # site and micro-batch was 704 reads before they stayed on the device)
    assert steps[4]["exempt"]["CPU only"] > 100  # the amax checks are seen, and set apart
    assert "megatron_ext/training/loop.py" in " ".join(steps[2]["sources"])
