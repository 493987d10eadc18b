"""The refresh memory model (``memory.py``) by hand, and the start-up check's one line."""

import pytest

from megatron_ext.errors import UsageError
from megatron_ext.methods.snip import memory
from megatron_ext.precision.cost import ModelShape


def test_refresh_memory_by_hand():
    sites = [(6, 4), (4, 2)]  # N x K: 24 and 8 elements
    one = memory.refresh_memory(40, 2, sites, tokens=10, micro_batches=1, dp=1, sums_per_site=5)
    assert one.snapshot == 80 and one.adam == 4 * 32 and one.base_grad == 4 * 32
    assert one.accumulators == 8 * 4 * 24  # one micro-batch: the largest site's dw + weighing
    dp2 = memory.refresh_memory(40, 2, sites, tokens=10, micro_batches=1, dp=2, sums_per_site=5)
    assert dp2.accumulators == 8 * 5 * 24  # with DP its errors are summed until reduced
    assert one.transient == 8 * (3 * 10 * 6 + 2 * 10 * 4) + 4 * 2 * 10 * 6
    many = memory.refresh_memory(40, 2, sites, tokens=10, micro_batches=4, dp=1, sums_per_site=5)
    assert many.accumulators == 8 * 5 * 32 and many.base_grad == 8 * 32  # every site, float64
    assert many.total == sum([80, 128, 256, 8 * 5 * 32, one.transient])
    host, disk = (memory.refresh_memory(40, 2, sites, tokens=10, micro_batches=4, dp=1,
                                        sums_per_site=5, offload=o) for o in ("host", "disk"))
    for moved in (host, disk):  # one site's A² (FP32) and dw (float64) stay, no snapshot
        assert moved.snapshot == 0 and moved.adam == 4 * 24 and moved.base_grad == 8 * 24
        assert moved.total == sum([4 * 24, 8 * 24, 8 * 5 * 32, one.transient])
    kept = 80 + (4 + 8) * 32  # snapshot, every A² and dw
    assert (host.host, host.disk, disk.host, disk.disk) == (kept, 0, 0, kept)


def test_sites_in_groups_hold_the_largest_groups_sums():
    """--snip-sites-per-pass: with several micro-batches only the observed group's sites sum
    (and keep their base dw); A² is still every site's."""
    sites = [(6, 4), (4, 2), (2, 2), (5, 4)]  # 24, 8, 4 and 20 elements
    kw = dict(tokens=10, micro_batches=4, dp=1, sums_per_site=5)
    whole = memory.refresh_memory(40, 2, sites, **kw)
    pairs = memory.refresh_memory(40, 2, sites, sites_per_pass=2, **kw)  # 24+8, 4+20
    assert (whole.accumulators, pairs.accumulators) == (8 * 5 * 56, 8 * 5 * 32)
    assert (whole.base_grad, pairs.base_grad) == (8 * 56, 8 * 32)
    assert pairs.adam == whole.adam == 4 * 56
    host = memory.refresh_memory(40, 2, sites, sites_per_pass=2, offload="host", **kw)
    assert host.host == 80 + 4 * 56 + 8 * 32 and host.accumulators == 8 * 5 * 32
    assert memory.refresh_memory(40, 2, sites, sites_per_pass=9, **kw) == whole


def test_local_sites_split_like_megatron():
    shape = ModelShape(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, swiglu=True, tokens=8)
    qkv = 64 + 2 * 2 * 16  # 4 query heads + 2 KV groups of head dim 16
    assert memory.local_sites(shape, [0], tp=2) == [(qkv // 2, 64), (64, 64 // 2),
                                                    (256 // 2, 64), (64, 128 // 2)]


def test_a_refresh_that_does_not_fit_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 3 * memory.GIB)
    need = memory.RefreshMemory(memory.GIB, memory.GIB, memory.GIB, 0, 0)
    memory.check_fits(need, activations=0.0)  # 3 GiB: fits
    with pytest.raises(UsageError, match=r"a SNIP refresh needs 3.00 GiB per rank .* more than "
                                         r"the 3.00 GiB free"):
        memory.check_fits(need, activations=1.0)
