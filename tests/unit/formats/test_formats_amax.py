"""formats/amax.py's device branch (CUDA tensors: no host read): on CPU by answering
``reads_host`` False, against the host-reading branch, which decides from the value."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ext.formats import amax as amax_module
from megatron_ext.formats import fake_quant


class HostReads(TorchDispatchMode):
    """Counts ``_local_scalar_dense`` (``item``, ``float``, ``bool`` of a tensor)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _tensor(special: bool) -> torch.Tensor:
    t = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3
    if special:
        t[3, 7], t[10, 200], t[63, 0] = float("nan"), float("inf"), -float("inf")
    return t


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp4_e2m1@block128", "mxfp4", "int8@row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_device_branch_quantizes_bit_for_bit_without_host_reads(monkeypatch, fmt, special,
                                                                   dtype):
    t = _tensor(special).to(dtype)
    with HostReads() as host:
        expected = fake_quant(t, fmt)
    assert host.count >= 1  # the CPU branch reads: a test that could fail
    monkeypatch.setattr(amax_module, "reads_host", lambda v: False)
    with HostReads() as device:
        got = fake_quant(t, fmt)
    assert device.count == 0
    assert torch.equal(got.view(torch.int64 if dtype == torch.float64 else torch.int32),
                       expected.view(torch.int64 if dtype == torch.float64 else torch.int32))


def test_finite_amax_device_branch_says_possibly_nonfinite(monkeypatch):
    t = _tensor(special=False)
    amax, nonfinite = amax_module.finite_amax(t, (0, 1), keepdim=False)
    assert not nonfinite
    monkeypatch.setattr(amax_module, "reads_host", lambda v: False)
    device_amax, device_nonfinite = amax_module.finite_amax(t, (0, 1), keepdim=False)
    assert device_nonfinite and torch.equal(device_amax, amax)
    assert float(amax) == t.abs().max().item()
