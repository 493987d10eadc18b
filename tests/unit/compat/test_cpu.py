"""One test per patch point of megatron_ext.compat.cpu, plus: inert when CUDA is present."""

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_ext.compat import cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for CPU-only")


@pytest.fixture(scope="module", autouse=True)
def active():
    assert cpu.activate() is True
    assert cpu.activate() is True  # idempotent
    assert cpu.is_active()
    yield
    cpu.deactivate()
    assert not cpu.is_active()
    assert torch._C._len_torch_function_stack() == 0
    from megatron.core.distributed import torch_fully_sharded_data_parallel as mcore_fsdp2
    from torch.distributed.device_mesh import DeviceMesh
    assert mcore_fsdp2.DeviceMesh is DeviceMesh  # patch point 6 undone


def test_current_device_is_usable_as_a_device():
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_current_device_works_inside_autograd_backward():
    # modes are switched off while Tensor.backward runs: megatron's TP layers allocate there
    class AllocInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return torch.zeros(grad.shape, device=torch.cuda.current_device()) + grad * 2

    x = torch.ones(3, requires_grad=True)
    AllocInBackward.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_rng_state_maps_to_cpu_generator():
    torch.cuda.manual_seed(123)
    expected = torch.rand(4)
    torch.cuda.manual_seed(123)
    state = torch.cuda.get_rng_state()
    assert torch.equal(torch.rand(4), expected)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4), expected)


def test_megatron_rng_tracker_forks_cpu_streams():
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    torch.manual_seed(0)
    outside = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("model-parallel-rng"):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), outside)  # default stream untouched by the fork
    assert not torch.equal(inside, outside)
    assert mcore_random._get_cuda_rng_state() is not None


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda"), 0])
def test_factory_devices_rewritten_to_cpu(device):
    assert torch.zeros(2, device=device).device.type == "cpu"
    assert torch.ones(2).to(device).device.type == "cpu"


def test_tensor_cuda_is_identity():
    t = torch.ones(2)
    assert t.cuda() is t


def test_type_string_reports_cuda_name():
    # megatron's clip-grad asserts grad.type() == 'torch.cuda.FloatTensor'
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type(torch.float64).dtype == torch.float64  # conversions still work


def test_synchronize_and_empty_cache_are_noops():
    assert torch.cuda.synchronize() is None
    assert torch.cuda.empty_cache() is None


def test_fsdp2_wrapper_mesh_is_cpu_and_shards_train(tmp_path):
    # megatron's TorchFullyShardedDataParallel asks for a "cuda" mesh; torch's fully_shard on
    # it stops with "Torch not compiled with CUDA enabled"
    import torch.distributed as dist
    from megatron.core.distributed import torch_fully_sharded_data_parallel as mcore_fsdp2
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        mesh = mcore_fsdp2.DeviceMesh.from_group(dist.group.WORLD, "cuda")
        assert mesh.device_type == "cpu"
        layer = torch.nn.Linear(4, 2, bias=False)
        expected = layer.weight.detach().clone()
        fully_shard(layer, mesh=mesh)
        layer(torch.ones(3, 4)).sum().backward()
        assert isinstance(layer.weight, DTensor)
        assert torch.equal(layer.weight.full_tensor(), expected)
        assert torch.equal(layer.weight.grad.full_tensor(), torch.full((2, 4), 3.0))
    finally:
        dist.destroy_process_group()


def test_inert_when_cuda_is_present():
    script = textwrap.dedent("""
        from unittest import mock
        import torch
        from megatron.core.distributed import torch_fully_sharded_data_parallel as mcore_fsdp2
        from torch.distributed.device_mesh import DeviceMesh
        before = torch.cuda.current_device
        with mock.patch.object(torch.cuda, "is_available", return_value=True):
            from megatron_ext.compat import cpu
            assert cpu.activate() is False
        assert torch.cuda.current_device is before
        assert mcore_fsdp2.DeviceMesh is DeviceMesh
        assert not cpu.is_active()
        assert torch._C._len_torch_function_stack() == 0
        print("inert")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "inert" in out.stdout


def test_gpu_only_advice_of_tp_layers_is_silent_on_cpu():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu.activate()  # installs its filter inside this context
        warnings.warn("When using async grad allreduce it is recommended to set the "
                      "environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum "
                      "speedup", UserWarning)
        warnings.warn("another warning", UserWarning)
    assert [str(w.message) for w in caught] == ["another warning"]
