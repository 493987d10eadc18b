"""``--snip-offload``'s tensor store (``tensor_store.py``): what comes back is bit for bit what
was put, from memory or from files; a view is written as its own elements only; files go when
freed and the folder when the store is closed (or dropped); the weight snapshot swaps the
same values in and out from disk as from memory."""

import gc

import pytest
import torch

from megatron_ext.methods.snip.refresh import WeightSnapshot
from megatron_ext.methods.snip.tensor_store import TensorStore, resolve


def _tensors():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 48, generator=g, dtype=torch.float64)
    return [torch.randn(5, 7, generator=g).bfloat16(), big[8:12],  # a view of a larger tensor
            torch.rand(33, generator=g) * 1e-30, big.t()]


@pytest.mark.parametrize("offload", ["none", "host", "disk"])
def test_put_get_round_trip_is_bit_exact_and_files_go(offload, tmp_path):
    store = TensorStore.for_offload(offload, str(tmp_path))
    tensors = _tensors()
    originals = [t.clone() for t in tensors]
    held = [store.put(t, copy=True) for t in tensors]
    for t in tensors:
        t.add_(1)  # the store keeps a copy
    for t, h in zip(originals, held):
        back = h.get(torch.device("cpu"))
        assert back.dtype == t.dtype and back.shape == t.shape and back.stride() == t.stride()
        assert torch.equal(back.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8))
    if offload == "disk":
        folder, = tmp_path.iterdir()
        assert sorted(p.name for p in folder.iterdir()) == ["0.pt", "1.pt", "2.pt", "3.pt"]
        assert (folder / "1.pt").stat().st_size < 4 * 48 * 8 + 4096  # 4 rows, not 64 (24 KiB)
        held[0].free()
        assert not (folder / "0.pt").exists()
    store.close()
    store.close()  # once only
    assert list(tmp_path.iterdir()) == []


def test_a_disk_store_used_as_a_block_is_removed_also_on_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="mid-refresh"):
        with TensorStore.for_offload("disk", str(tmp_path)) as store:
            store.put(torch.ones(3))
            assert len(list(tmp_path.iterdir())) == 1
            raise RuntimeError("mid-refresh")
    assert list(tmp_path.iterdir()) == []


def test_an_unclosed_disk_store_is_removed_when_dropped(tmp_path):
    store = TensorStore.for_offload("disk", str(tmp_path))
    store.put(torch.ones(3))
    assert len(list(tmp_path.iterdir())) == 1
    del store
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_auto_is_host_on_a_gpu_and_none_elsewhere():
    assert resolve("auto", "cuda") == "host" and resolve("auto", "cpu") == "disk"
    assert [resolve(o, "cpu") for o in ("host", "disk", "none")] == ["host", "disk", "none"]


def test_snapshot_from_disk_swaps_the_same_values_as_in_memory(tmp_path):
    """Snapshot, change the weights (a step), swap: the snapshot's values are in place; swap
    back: the changed ones; from disk exactly as from memory."""
    torch.manual_seed(3)
    model = [torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4))]
    before = [p.detach().clone() for p in model[0].parameters()]
    snaps = [WeightSnapshot(model, TensorStore()),
             WeightSnapshot(model, TensorStore.for_offload("disk", str(tmp_path)))]
    with torch.no_grad():
        for p in model[0].parameters():
            p.mul_(1.5).add_(0.25)
    after = [p.detach().clone() for p in model[0].parameters()]
    for snap in snaps:
        with snap.swapped():
            assert all(torch.equal(p, b) for p, b in zip(model[0].parameters(), before))
        assert all(torch.equal(p, a) for p, a in zip(model[0].parameters(), after))
        snap.store.close()
    assert list(tmp_path.iterdir()) == []


def test_a_host_store_keeps_a_copy_and_sums_where_the_tensor_is():
    """``host``: a copy (the original may change after ``put``), brought to any device, and
    ``total`` the float64 sum made before the copy, as a tensor of the source's device."""
    source = torch.rand(64, 48, dtype=torch.float32) * 1e3
    held = TensorStore(torch.device("cpu")).put(source, total=True)
    expected, total = source.clone(), source.double().sum()
    source.add_(1)
    assert held.host_copy and torch.equal(held.get(), expected)
    assert torch.equal(held.get(torch.device("cpu")), expected)
    assert held.total.dtype == torch.float64 and torch.equal(held.total, total)
    held.free()
    assert held.tensor is None and held.total is None and not held.host_copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_a_host_store_copies_cuda_tensors_to_pinned_memory_without_a_wait():
    """A CUDA tensor goes to pinned host memory with the copy queued (an event marks its
    end); it comes back to the GPU queued too, and the host reads it after the event."""
    source = torch.randn(1024, 1024, device="cuda")
    expected = source.clone()
    held = TensorStore(torch.device("cpu")).put(source, total=True)
    source.mul_(2)  # queued after the copy out: the store keeps the old values
    assert held.tensor.is_pinned() and held.ready is not None and held.total.is_cuda
    assert torch.equal(held.get(source.device), expected)
    assert torch.equal(held.get(), expected.cpu())
