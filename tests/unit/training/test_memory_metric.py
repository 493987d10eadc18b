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


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_trim_heap_returns_freed_heap_chunks():
    """glibc keeps freed heap chunks resident (the last chunk pins the heap's top); trim_heap
    gives their pages back, which is what keeps a SNIP refresh's RSS near its live memory."""
    from megatron_ext.training.memory import _malloc_trim, trim_heap

    if _malloc_trim() is None:
        pytest.skip("no glibc malloc_trim")
    big = torch.ones(24 * 2 ** 20 // 4)
    del big  # a freed 24 MiB mapping lifts glibc's mmap threshold
    chunks = [torch.ones(2 ** 20 // 4) for _ in range(256)]  # 256 x 1 MiB, now from the heap
    last = chunks.pop()
    before = _rss_mib()
    del chunks
    kept = _rss_mib()
    trim_heap()
    after = _rss_mib()
    assert before - kept < 64, (before, kept)  # freed, yet resident
    assert kept - after > 192, (kept, after)
    del last
