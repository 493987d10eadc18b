"""megatron-core on CPU: the one deliberate patch of this project for running on CPU.

(The other replacement of megatron-core internals is not about the device: megatron's own
local gradient-norm and clip fallbacks are swapped for foreach drop-ins by
``training/fused_optimizer.py:use_foreach_grad_norm``.)

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths of
training. When CUDA is absent, :func:`activate` patches exactly those places so the *same*
megatron-core model, pipeline schedules, DDP, optimizer and dist_checkpointing run on CPU with
the gloo backend. With CUDA present it does nothing, so GPU runs are untouched.

Patch points (each has its own test in ``tests/unit/compat/test_cpu.py``):

1. **Current device.** ``torch.cuda.current_device()`` is called directly, mostly as
   ``device=torch.cuda.current_device()`` (rotary embeddings, buffers, and inside autograd
   ``backward`` of the tensor-parallel layers) -> returns ``torch.device("cpu")``. It must work
   without the mode below: a TorchFunctionMode is switched off while ``Tensor.backward`` runs
   (the mode is popped during its own ``__torch_function__``), so backward code sees no mode.
2. **RNG.** The model-parallel RNG tracker saves and restores CUDA generator states
   (``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` in ``tensor_parallel.random`` and
   ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed``) -> the CPU generator
   ``torch.default_generator``. ``torch.manual_seed`` itself calls
   ``torch.cuda.manual_seed_all``, so ``torch.cuda.manual_seed`` is pointed at the generator
   directly, never at ``torch.manual_seed`` (that would recurse).
3. **Factory devices.** ``torch.empty(..., device='cuda')``, ``Tensor.cuda()``,
   ``Tensor.to('cuda')`` -> a :class:`torch.overrides.TorchFunctionMode` rewrites any CUDA
   device (a string, a ``torch.device`` or a bare index) to ``cpu`` in one place.
4. **Type strings.** clip-grad asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` ->
   the same mode answers ``Tensor.type()`` (no argument) with the CUDA name of the CPU type.
5. **Synchronisation.** ``torch.cuda.synchronize`` / ``empty_cache`` -> no-ops.
6. **FSDP2 device mesh.** megatron-core's ``TorchFullyShardedDataParallel`` builds its mesh as
   ``DeviceMesh.from_group(dp_group, "cuda")``; torch's ``fully_shard`` then places every
   shard on that mesh's device type and asks the CUDA device handle for it. The name
   ``DeviceMesh`` *inside that megatron module* is replaced by :class:`CpuDeviceMesh`, whose
   ``from_group`` builds the same mesh over the same group with device type ``cpu`` (gloo
   then all-gathers and reduce-scatters the shards). torch's own ``DeviceMesh`` is untouched.
"""

from __future__ import annotations

import warnings

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE_MODE: "CudaToCpuMode | None" = None
_ORIGINALS: dict = {}


def _to_cpu_device(device):
    """Map a CUDA device spec (str, torch.device, int index) to CPU; leave others alone."""
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in every torch call (patch points 3 and 4)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], torch.Tensor):
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return args[0].type().replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _cpu_rng_state(device=None, clone=False, graph_safe=False):
    state = torch.default_generator.get_state()
    return state.clone() if clone else state


def _set_cpu_rng_state(new_state, device=None, graph_safe=False):
    torch.default_generator.set_state(new_state)


def _seed_cpu_generator(seed):
    torch.default_generator.manual_seed(int(seed))


def _noop(*args, **kwargs):
    return None


class CpuDeviceMesh:
    """Stands in for ``DeviceMesh`` in megatron's FSDP2 wrapper (patch point 6)."""

    @staticmethod
    def from_group(group, device_type: str, *args, **kwargs):
        """torch's ``DeviceMesh.from_group`` with a CUDA device type mapped to ``cpu``."""
        from torch.distributed.device_mesh import DeviceMesh

        cpu_type = "cpu" if device_type.startswith("cuda") else device_type
        return DeviceMesh.from_group(group, cpu_type, *args, **kwargs)


def _patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, CPU replacement) for every patched function."""
    from megatron.core.distributed import torch_fully_sharded_data_parallel as mcore_fsdp2
    from megatron.core.tensor_parallel import random as mcore_random

    return [
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (torch.cuda, "get_rng_state", _cpu_rng_state),
        (torch.cuda.random, "get_rng_state", _cpu_rng_state),
        (torch.cuda, "set_rng_state", _set_cpu_rng_state),
        (torch.cuda, "manual_seed", _seed_cpu_generator),
        (torch.cuda, "synchronize", _noop),
        (torch.cuda, "empty_cache", _noop),
        (mcore_random, "_get_cuda_rng_state", _cpu_rng_state),
        (mcore_random, "_set_cuda_rng_state", _set_cpu_rng_state),
        (mcore_fsdp2, "DeviceMesh", CpuDeviceMesh),
    ]


def is_active() -> bool:
    """True once :func:`activate` has patched this process."""
    return _ACTIVE_MODE is not None


GPU_ONLY_ADVICE = r"When using .* set the environment variable CUDA_DEVICE_MAX_CONNECTIONS"
"""megatron-core's advice to TP layers (once per rank) that only means something on a GPU."""


def activate() -> bool:
    """Patch megatron-core / torch.cuda for CPU if CUDA is absent. Idempotent.

    Returns True if the CPU layer is active after the call, False on a CUDA machine.
    """
    global _ACTIVE_MODE
    if torch.cuda.is_available():
        return False
    warnings.filterwarnings("ignore", message=GPU_ONLY_ADVICE, category=UserWarning)
    if _ACTIVE_MODE is not None:
        return True
    for owner, name, replacement in _patches():
        _ORIGINALS[(owner, name)] = getattr(owner, name)
        setattr(owner, name, replacement)
    _ACTIVE_MODE = CudaToCpuMode()
    _ACTIVE_MODE.__enter__()
    return True


def deactivate() -> None:
    """Undo :func:`activate` (tests use it to leave the process as they found it)."""
    global _ACTIVE_MODE
    if _ACTIVE_MODE is None:
        return
    _ACTIVE_MODE.__exit__(None, None, None)
    _ACTIVE_MODE = None
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    _ORIGINALS.clear()
