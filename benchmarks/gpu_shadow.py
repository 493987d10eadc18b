"""Where a GPU run would keep each tensor, followed on CPU (used by ``host_syncs.py``).

On CPU every tensor is a host tensor, so code that mixes host and device tensors, or copies
host data to the device once per site, runs fine here and fails or stalls on a GPU: a
``torch.stack`` of a device scalar and a host one raises there, and every blocking copy to
the device (``torch.tensor(values, device=...)``, ``t.to(device)`` of a host tensor without
``non_blocking``) waits for the kernels queued before it, like a read does. This module marks
each tensor with where a GPU run would place it, as an attribute (:data:`ON_DEVICE`):

* ``True``, on the device: the model's parameters and gradients, a tensor made with a CUDA
  device, with this rank's device (``distributed.device()`` and megatron's
  ``torch.cuda.current_device()`` return :data:`DEVICE`, a CPU device object whose identity
  says "the GPU"), or with a device tensor's ``.device``, and whatever an op makes from a
  device tensor or through a collective;
* ``False``, on the host: made by this project or megatron-core from host data or with no
  device or an explicit ``"cpu"`` (``torch.tensor(x)``, ``torch.zeros(n)``,
  ``torch.from_numpy``), a ``.cpu()`` / ``.to("cpu")`` copy, and what ops make from host
  tensors only;
* unmarked: unknown (made by torch's own code, under :data:`CPU_ONLY` code, or by a C++
  path no function mode sees); never reported.

:class:`PlacementMode` (a ``TorchFunctionMode``, on in the backward too) marks where a call
names a device (and reports what it makes there from no device tensor: a launch, for
``launch_count.py``); :func:`check` (called from the counting ``TorchDispatchMode`` for
every op) reports an op that would mix devices on a GPU (:data:`MIXED`) and names the copies
between them; :class:`Shadow` puts it all in place for a ``with`` block. A branch on
``t.is_cuda`` takes its CPU side unless ``cuda_branches`` (``host_syncs.py --cuda-branches``)
makes device tensors say ``is_cuda``: then the GPU side runs, its Triton kernels in Triton's
interpreter.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.autograd as autograd
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

REPO = Path(__file__).resolve().parents[1]
ON_DEVICE = "_gpu_shadow_on_device"
"""The attribute: True on the device in a GPU run, False on the host, absent: unknown."""
DEVICE = torch.device("cpu")
"""What this rank's device is on CPU while shadowing: this very object means the GPU."""
OUR_CODE = (str(REPO / "megatron_ext"), f"{Path('megatron') / 'core'}")
CPU_ONLY = {str(REPO / "megatron_ext" / p) for p in ("formats/amax.py",
                                                      "methods/stquant/cpu_step.py")}
"""Code a GPU run does not take: the formats' amax check reads on the host only where that
is free (``reads_host`` is False for CUDA tensors); STQuant's compiled CPU step (a Triton
kernel on CUDA). ``host_syncs.py`` lists what happens under it apart."""
FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
"""Calls that make a tensor from host data: with a device, a blocking copy to it."""
FACTORIES = FROM_DATA | {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
                         torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye}
"""Calls that make a tensor on the named device, the host when none is named."""
UNWRITTEN = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}
"""Calls that make a tensor without writing it: no kernel on the device."""
aten = torch.ops.aten


ON_A_GPU = torch.cuda.is_available()
"""A real GPU: a tensor's place is its device (a mark, carried through a copy to the host
by the ops' rule "outputs where the inputs are", would count host reads as device ones)."""


def placement(t) -> bool | None:
    """True: a GPU run keeps ``t`` on the device; False: on the host; None: unknown."""
    if not isinstance(t, torch.Tensor):
        return None
    return t.device.type == "cuda" if ON_A_GPU else getattr(t, ON_DEVICE, None)


def mark(tensors, on_device: bool = True) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            setattr(t, ON_DEVICE, on_device)


def intent(device) -> bool | None:
    """Where ``device`` (an argument of a torch call) places a tensor in a GPU run."""
    if device is None:
        return None
    if device is DEVICE or isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


def _ours() -> bool:
    """Whether the torch call being handled was made by this project or megatron-core, and
    not under :data:`CPU_ONLY` code (whose tensors, cached ones too, stay unknown)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None or not any(p in frame.f_code.co_filename for p in OUR_CODE):
        return False
    while frame is not None and frame.f_code.co_filename not in CPU_ONLY:
        frame = frame.f_back
    return frame is None


def _move(func, args, kwargs) -> tuple[bool | None, bool]:
    """For ``Tensor.to`` / ``Tensor.cuda``: where the copy goes (None: not a move, or a move
    to an unknown place) and whether it waits (no ``non_blocking``)."""
    blocking = not kwargs.get("non_blocking", False)
    if func is torch.Tensor.cuda:
        return True, blocking
    if func is not torch.Tensor.to:
        return None, blocking
    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, bool):
            blocking = not a  # to(device, dtype, non_blocking)
        elif isinstance(a, torch.Tensor):
            return placement(a), blocking
        elif isinstance(a, (str, int, torch.device)):
            target = a
    return intent(target), blocking


class PlacementMode(TorchFunctionMode):
    """Marks the tensors whose placement a call names (module docstring) and calls
    ``on_copy(kind)`` for each blocking copy between host and device that it sees: an
    ``"upload"`` of host data, a ``"read"`` of a device tensor (``.to("cpu")``; ``.cpu()``
    is counted by ``host_syncs.py``'s own wrapper); and ``on_copy("launch")`` for a tensor
    made on the device from no device tensor (a kernel or a copy in a GPU run, which no
    dispatched op shows: its op sees host tensors or none)."""

    def __init__(self, on_copy):
        super().__init__()
        self.on_copy = on_copy

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            return self._backward(func, args, kwargs)
        target, blocking = _move(func, args, kwargs)
        move = target is not None
        if not move and (func in FACTORIES or kwargs.get("device") is not None):
            target = intent(kwargs.get("device")) or False  # empty_like(t, device="cpu") too
        if kwargs.get("pin_memory"):  # a GPU branch's pinned copy (--cuda-branches)
            kwargs["pin_memory"] = False
        out = func(*args, **kwargs)
        if target is None or not _ours():
            return out
        if move:
            source = placement(args[0])
            if out is args[0] and source is not None and source is not target:
                out = out.clone()  # a copy on a GPU, the tensor itself on CPU
            if blocking and source is not None and source is not target:
                self.on_copy("upload" if target else "read")
            launch = target and source is False  # a download's op is on a device tensor
        else:
            if target and func in FROM_DATA and blocking:
                self.on_copy("upload")
            launch = target and func not in UNWRITTEN and not any(
                placement(t) for t in pytree.tree_leaves((args, kwargs)))
        if launch:
            self.on_copy("launch")
        mark(pytree.tree_leaves(out), target)
        return out

    def _backward(self, func, args, kwargs):
        """The backward with this mode on (torch runs it with every function mode off), so
        the tensors its hooks make are placed too; ``autograd.backward``'s own torch-function
        check is off meanwhile, or it would come back here."""
        if func is torch.Tensor.backward:  # (self, gradient, retain_graph, create_graph, inputs)
            names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "inputs")
            kwargs = {**dict(zip(names, args)), **{("grad_tensors" if k == "gradient" else k): v
                                                   for k, v in kwargs.items()}}
            args = ()
        check, autograd.has_torch_function = autograd.has_torch_function, lambda _: False
        try:
            with self:
                return torch.autograd.backward(*args, **kwargs)
        finally:
            autograd.has_torch_function = check


class DeviceProperty:
    """A ``Tensor`` attribute while shadowing: ``on_device`` for a device tensor, torch's
    own for the rest. ``Tensor.device`` gives :data:`DEVICE`, so a tensor made
    ``device=t.device`` is marked as ``t`` is; with ``--cuda-branches`` ``Tensor.is_cuda``
    gives True, so the code takes its GPU branches."""

    def __init__(self, name: str, on_device):
        self.name, self.on_device = name, on_device
        self.original = getattr(torch._C.TensorBase, name)

    def __get__(self, tensor, owner=None):
        if tensor is None:
            return self
        if placement(tensor):
            return self.on_device
        if getattr(type(tensor).__torch_function__, "__func__", None) is _PLAIN:
            return self.original.__get__(tensor, owner)
        # a subclass handling torch functions itself (a ShardedTensor) answers torch's own
        # getter only, which finds it on torch.Tensor: put that back for the call
        delattr(torch.Tensor, self.name)
        try:
            return getattr(tensor, self.name)
        finally:
            setattr(torch.Tensor, self.name, self)


_PLAIN = torch.Tensor.__torch_function__.__func__


MIXED = "mixed devices"
"""What :func:`check` reports for an op a GPU run would refuse."""


def check(func, args, kwargs) -> tuple[str | None, bool | None]:
    """For one dispatched op: what it does across devices (:data:`MIXED`, or ``"upload"`` /
    ``"read"`` for a blocking ``copy_`` between them; None), and where its outputs are (None:
    unknown)."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    where = [placement(t) for t in tensors]
    if func is aten.copy_.default:  # copy_(dst, src, non_blocking)
        dst, src = placement(args[0]), placement(args[1])
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        kind = {(True, False): "upload", (False, True): "read"}.get((dst, src))
        return (kind if blocking else None), dst
    if func.namespace == "c10d":  # NCCL takes device tensors only
        return (MIXED if False in where else None), True
    if True in where and False in where:
        scalars = all(t.dim() == 0 for t, w in zip(tensors, where) if w is False)
        if not (scalars and torch.Tag.pointwise in func.tags):
            return MIXED, True
    if True in where:
        return None, True
    return None, (False if where and all(w is False for w in where) else None)


def _host_made(make):
    """``make`` (a torch function no function mode sees), marking what it makes as host."""
    def made(*args, **kwargs):
        out = make(*args, **kwargs)
        if _ours():
            mark([out], False)
        return out
    return made


def describe(args, kwargs) -> str:
    """An op's tensor arguments by placement and shape: ``device (4, 4), host () x 3``."""
    seen: dict[tuple, int] = {}
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            key = ({True: "device", False: "host"}.get(placement(t), "unknown"), tuple(t.shape))
            seen[key] = seen.get(key, 0) + 1
    return ", ".join(f"{where} {shape}" + (f" x {n}" if n > 1 else "")
                     for (where, shape), n in seen.items())


class _Event:
    """``torch.cuda.Event`` under ``--cuda-branches``: recording is free, waiting is a read."""

    def __init__(self, on_copy):
        self.on_copy = on_copy

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        self.on_copy("read")


class Shadow:
    """On a machine without CUDA, the placement of a GPU run while in a ``with`` block:
    megatron-core's CPU patch first (``compat.cpu``), then this rank's device as
    :data:`DEVICE`, ``Tensor.device`` as :class:`DeviceProperty` and a
    :class:`PlacementMode` on top, which sees each call before the CPU patch rewrites its
    CUDA device. Tensors made before are unmarked; ``mark`` the model."""

    def __init__(self, on_copy, cuda_branches: bool = False):
        self.mode = PlacementMode(on_copy)
        self.cuda_branches = cuda_branches
        """Device tensors say ``is_cuda``: the code takes its GPU branches (the Triton
        kernels run in Triton's interpreter; a CUDA event's wait is a read)."""
        self._undo: list[tuple[object, str, object]] = []
        self._activated = False  # whether entering turned megatron's CPU patch on

    def __enter__(self) -> Shadow:
        from megatron_ext.compat import cpu
        from megatron_ext.training import distributed

        self._activated = not cpu.is_active()
        cpu.activate()
        owners = [m for m in list(sys.modules.values()) if m.__name__.startswith("megatron_ext")
                  and getattr(m, "device", None) is distributed.device]
        patches = [(torch.cuda, "current_device", lambda: DEVICE),
                   (torch, "from_numpy", _host_made(torch.from_numpy)),
                   (torch.Tensor, "device", DeviceProperty("device", DEVICE)),
                   *((m, "device", lambda: DEVICE) for m in owners)]
        if self.cuda_branches:
            on_copy = self.mode.on_copy
            patches += [(torch.Tensor, "is_cuda", DeviceProperty("is_cuda", True)),
                        (torch.cuda, "Event", lambda *a, **k: _Event(on_copy)),
                        (torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))]
        for owner, name, value in patches:
            self._undo.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, value)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        for owner, name, value in reversed(self._undo):
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._undo.clear()
        if self._activated:
            from megatron_ext.compat import cpu
            cpu.deactivate()
