"""``mem_gib`` per logged step on CPU: the peak since the previous logged step (peak RSS)."""

import sys

import pytest
import torch

from pretrain_runner import FAST_ARGS, launch, read_metrics
from megatron_ext.training.memory import PeakMemory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")


def test_peak_rss_sees_a_freed_tensor_and_resets():
    memory = PeakMemory(cuda=False)
    assert memory.resettable
    quiet = memory.read()
    big = torch.ones(384 * 2 ** 20 // 4)  # 384 MiB, every page written
    del big
    seen = memory.read()
    after = memory.read()
    assert seen - quiet > 0.3, (quiet, seen)
    assert seen - after > 0.3, (seen, after)  # the next interval starts from the current RSS


def test_metrics_carry_the_peak_of_each_logged_step(tmp_path):
    run = tmp_path / "run"
    launch([*FAST_ARGS, "--train-iters", "5", "--run-dir", str(run)],
           script="tests/unit/training/pretrain_memory_seam.py")
    mem = {r["step"]: r["mem_gib"] for r in read_metrics(run) if "loss" in r}
    assert sorted(mem) == [1, 2, 3, 4, 5]
    assert all(0.1 < m < 64 for m in mem.values()), mem
    big = 0.5  # GiB held before step 3 (tests/unit/training/pretrain_memory_seam.py)
    assert mem[3] - mem[2] > 0.8 * big, mem
    assert mem[3] - mem[4] > 0.8 * big, mem
