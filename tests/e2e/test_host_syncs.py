"""benchmarks/host_syncs.py: its counter against hand-made reads (a device tensor's ``item``
and ``.cpu()`` count, a host tensor's do not) and launches (``launch_count.py``), its GPU
shadow (``gpu_shadow.py``) against hand-made mixed-device ops and uploads, and the composed
run (SNIP + GNMR + STQuant) reading the host a handful of times per step, not per site: a
refresh read 879 times on this model when each statistic was a ``float()``, the formats'
amax check 144 per step."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_ext.methods.snip.tensor_store import TensorStore
from pretrain_runner import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_shadow  # noqa: E402
import host_syncs  # noqa: E402

TRAIN = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length",
         "64", "--lr-warmup-iters", "1", "--eval-iters", "0", "--train-iters", "6",
         "--log-interval", "100", "--no-save", "--precision", "snip", "--snip-start", "3",
         "--snip-interval", "0", "--snip-offload", "host", "--gnmr", "--optimizer",
         "stquant-adamw"]
"""SNIP's refresh keeps its tensors on the host, as on a GPU (``--snip-offload auto``)."""


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


def test_on_a_gpu_a_tensors_place_is_its_device(monkeypatch):
    """On a GPU the marks are not read: ``flat.cpu()[i]`` of a device ``flat`` is a host
    tensor (the count read SNIP's 608 host floats as device reads on the H100)."""
    marked = torch.ones(2)
    host_syncs.mark([marked])
    assert host_syncs.on_device(marked)
    monkeypatch.setattr(gpu_shadow, "ON_A_GPU", True)
    assert not host_syncs.on_device(marked)  # a CPU tensor, whatever its mark


def test_cudas_sync_warnings_are_counted_by_step_and_source():
    counter = host_syncs.SyncCounter()
    counter.cuda_syncs, counter.logged, counter.step = {}, {1: False}, 1  # as on a GPU
    counter._on_warning(UserWarning("called a synchronizing CUDA operation"))
    counter._on_warning(UserWarning("called a synchronizing CUDA operation"))
    step, = counter.steps()
    assert step["cuda_syncs"] == 2 and sum(step["cuda_sync_sources"].values()) == 2


def test_counts_launches_of_ops_on_device_tensors_and_triton_kernels(monkeypatch):
    """One launch per op on device tensors, per tensor made on the device from none and per
    copy between host and device; none for a view, an allocation or an op on host tensors;
    one per Triton kernel run, the ops Triton's interpreter runs for it not counted."""
    tl = pytest.importorskip("triton.language")
    # what triton.jit gives under TRITON_INTERPRET=1
    from triton.runtime.interpreter import InterpretedFunction

    def double(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    monkeypatch.setattr(gpu_shadow, "OUR_CODE", (*gpu_shadow.OUR_CODE, __file__))
    counter = host_syncs.SyncCounter()
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    host_syncs.mark([a, b])
    with counter:
        host = torch.arange(4.0)  # on the host: none
        total = a + b  # 1
        a.view(16), a.t(), a[0], a.detach()  # views: none
        torch.empty_like(a), torch.empty(4, device=a.device), host * 2  # none
        torch.zeros(4, device=a.device)  # 2: a fill
        host.to(a.device, non_blocking=True)  # 3: a copy to the device
        total.cpu()  # 4 (and a read)
        kernel = InterpretedFunction(double)
        # ops inside the kernel's run, on the interpreter's host copy of its argument (its
        # own copies launch nothing by the rule): not counted, nor is a read there
        kernel.add_pre_run_hook(lambda x, *rest, **kw: (x.clone(), x.sum().item()))
        kernel[(1,)](total, 16, BLOCK=16)  # 5
    assert sum(counter.launches[0].values()) == 5, counter.launches
    assert sum(counter.reads[0].values()) == 1 and not counter.uploads
    assert torch.equal(total, 2 * (a + b))  # the kernel ran
    assert InterpretedFunction.run.__qualname__ == "InterpretedFunction.run"  # unpatched


def test_composed_run_reads_the_host_per_step_not_per_site(tmp_path):
    out = tmp_path / "syncs.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_syncs.py"), "--json",
                           str(out), "--", *TRAIN, "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {s["step"]: s for s in json.loads(out.read_text())}
    assert sorted(steps) == list(range(1, 7))
    # loss, the all-reduced non-finite flag, grad norm; GNMR's reduce (1); STQuant's widths
    # (1, steps < 5); the plan check after SNIP's switch at step 5 (3); step 1 is logged
    for step in (2, 3, 5):
        assert steps[step]["count"] <= 10, steps[step]
    assert steps[4]["count"] <= 25, steps[4]  # the refresh: 17 (a float() per statistic,
    # site and micro-batch was 704 reads before they stayed on the device; a blocking copy
    # to the host per stored tensor ~140 more)
    assert steps[4]["exempt"]["CPU only"] > 100  # the amax checks are seen, and set apart
    assert "megatron_ext/training/loop.py" in " ".join(steps[2]["sources"])
    # as a GPU run places them: no op mixes host and device tensors (the script exits 1
    # otherwise); the refresh's host copies come back without a wait (5 uploads: its probe
    # noise and megatron's grad-norm flag, which every step uploads; a blocking copy back
    # per stored tensor was ~150 more, benchmarks/results/2026-11-27-host-syncs.md)
    assert not any(s["mixed"] for s in steps.values())
    assert steps[4]["uploads"] <= 8 and steps[2]["uploads"] <= 2, steps[4]["upload_sources"]


def test_the_shadow_places_tensors_as_a_gpu_run_would(monkeypatch):
    """On CPU: ops a GPU run would refuse for mixing host and device tensors are reported
    (a 0-dim host tensor in a pointwise op is allowed, as CUDA allows it), blocking copies of
    host data to the device count as uploads, a non-blocking one does not."""
    monkeypatch.setattr(gpu_shadow, "OUR_CODE", (*gpu_shadow.OUR_CODE, __file__))
    counter = host_syncs.SyncCounter()
    weight = torch.randn(4, 4)
    host_syncs.mark([weight])
    with counter:
        scale = torch.tensor(2.0)  # a host scalar
        assert gpu_shadow.placement(weight * scale) is True  # allowed: 0-dim, pointwise
        torch.stack([weight.sum(), scale])  # mixed 1
        weight + torch.ones(4, 4)  # mixed 2
        made = torch.zeros(4, device=weight.device)  # on the device, no copy
        assert gpu_shadow.placement(made + weight[0]) is True
        torch.tensor([1.0, 2.0], device=weight.device)  # upload 1
        host = torch.arange(4.0)
        assert gpu_shadow.placement(host) is False
        moved = host.to(weight.device)  # upload 2
        assert gpu_shadow.placement(moved) is True and gpu_shadow.placement(host) is False
        host.to(weight.device, non_blocking=True)  # not a wait
        back = weight.to("cpu")  # a read
        assert gpu_shadow.placement(back) is False and gpu_shadow.placement(weight) is True
    mixed = counter.mixed[0]
    assert sum(mixed.values()) == 2, mixed
    assert any("aten::stack of device (), host ()" in what for what in mixed), mixed
    assert sum(counter.uploads[0].values()) == 2 and sum(counter.reads[0].values()) == 1


def test_cuda_branches_take_the_gpu_side_of_the_host_store(monkeypatch):
    """``--cuda-branches``: a device tensor says ``is_cuda``, so SNIP's host store takes its
    GPU branch on CPU: a pinned copy out without a wait, back to the device without one, and
    the host waiting on the copy's CUDA event (a read) only where it reads the copy."""
    monkeypatch.setattr(gpu_shadow, "OUR_CODE", (*gpu_shadow.OUR_CODE, __file__))
    counter = host_syncs.SyncCounter(cuda_branches=True)
    weight = torch.randn(8, 8)
    host_syncs.mark([weight])
    with counter:
        assert weight.is_cuda and not torch.ones(2).is_cuda
        held = TensorStore(torch.device("cpu")).put(weight, total=True)
        assert held.ready is not None and gpu_shadow.placement(held.tensor) is False
        assert gpu_shadow.placement(held.total) is True  # summed where the weight is
        back = held.get(weight.device)  # queued: no wait
        assert gpu_shadow.placement(back) is True
        assert not counter.reads and not counter.uploads
        host = held.get()  # the host reads the copy: it waits on the event
        assert held.get(torch.device("cpu")) is held.tensor  # so when asked for on the host
    assert sum(counter.reads[0].values()) == 2 and not counter.uploads and not counter.mixed
    assert torch.equal(back, weight) and torch.equal(host, weight)
    assert not weight.is_cuda  # the shadow is gone


def test_the_gpu_branches_of_the_composed_run_mix_no_devices(tmp_path):
    """``--cuda-branches``: the composed run takes its GPU side on CPU (the Triton
    quantizers, STQuant's Triton step and GaussWS's sampling in Triton's interpreter, the
    amax without its host read, SNIP's pinned host copies), at a small shape: no op mixes
    host and device tensors, and the waits per step are the CPU side's."""
    out = tmp_path / "syncs.json"
    small = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "176",
             "--num-attention-heads": "2", "--seq-length": "32",
             "--max-position-embeddings": "32", "--micro-batch-size": "1",
             "--global-batch-size": "2", "--train-iters": "4", "--snip-start": "2",
             "--gaussws": "od"}
    flags = [a for i, a in enumerate(TRAIN) if a not in small and TRAIN[i - 1] not in small]
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "host_syncs.py"),
                           "--cuda-branches", "--json", str(out), "--", *flags,
                           *(x for kv in small.items() for x in kv),
                           "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {s["step"]: s for s in json.loads(out.read_text())}
    assert sorted(steps) == [1, 2, 3, 4] and not any(s["mixed"] for s in steps.values())
    assert not any(s["exempt"] for s in steps.values())  # no CPU-only code ran
    assert steps[2]["count"] <= 6 and steps[2]["uploads"] <= 1, steps[2]  # 5 and 1
    assert steps[3]["count"] <= 25 and steps[3]["uploads"] <= 8, steps[3]  # the refresh
    kernels = [src for src in steps[2]["launch_sources"] if "/triton_" in src]
    assert kernels and steps[2]["launches"] > 100, steps[2]["launch_sources"]  # Triton's seen
