"""Which calls launch a GPU kernel, for ``host_syncs.py``'s per-step count of launches.

On a GPU each launch costs the host its Python and driver time; a step whose host work
outlasts its kernels keeps the device waiting, and then a method's many small launches add
to the step time whatever the kernels cost (benchmarks/results/2026-11-27-host-time.md: the
TinyLlama-1.1B step looks like that, not yet confirmed on a GPU). A launch, counted one per
call, is

* a dispatched aten op on device tensors (:func:`is_launch`): on CPU where the GPU shadow
  places it (``gpu_shadow.check``); on a GPU where a tensor argument or output is on CUDA.
  Views and :data:`NO_KERNEL` launch nothing; a collective (``c10d``) and a ``copy_``
  between host and device (a memcpy) count;
* a Triton kernel's run (:class:`TritonLaunches`), the torch ops Triton's interpreter runs
  for it not counted;
* on CPU, what ``gpu_shadow`` sees made on the device from no device tensor (a factory,
  ``torch.tensor(data, device=...)``, a host tensor's move), which no op on device tensors
  shows.

One op is one launch: torch's own kernels inside one aten op (a fused optimizer's, a
matmul's split-K reduction) and the driver's work are not counted apart.
"""

from __future__ import annotations

import threading

import torch
from torch.utils import _pytree as pytree

import gpu_shadow

aten = torch.ops.aten
NO_KERNEL = {aten.detach, aten.alias, aten.lift_fresh, aten.empty_like, aten.empty,
             aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.set_,
             aten.resize_, aten._local_scalar_dense}
"""Ops (by overload packet) that launch nothing: metadata, allocation without a write;
``_local_scalar_dense`` (``item``, ``bool``) is counted as a read instead."""


def is_launch(func, args, kwargs, out, where: bool | None, on_gpu: bool) -> bool:
    """Whether a dispatched op launches a kernel: on a GPU (``on_gpu``) when a tensor
    argument or output is on CUDA, on CPU when the shadow places it on the device
    (``where``, from ``gpu_shadow.check``; for ``copy_``, either end)."""
    if func.is_view or func.overloadpacket in NO_KERNEL:
        return False
    if on_gpu:
        return any(isinstance(t, torch.Tensor) and t.is_cuda
                   for t in pytree.tree_leaves((args, kwargs, out)))
    if func is aten.copy_.default:
        return True in (gpu_shadow.placement(args[0]), gpu_shadow.placement(args[1]))
    return where is True


def _runs() -> list[type]:
    """The classes whose ``run`` launches a Triton kernel (compiled, interpreted); none
    without triton."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    return [JITFunction, InterpretedFunction]


class TritonLaunches:
    """In a ``with`` block: each Triton kernel run (not a warm-up's compile) calls
    ``on_launch()``, then runs with ``quiet.on`` set, so that the torch ops Triton's
    interpreter makes for it (copies of its arguments) are not counted."""

    def __init__(self, on_launch, quiet: threading.local):
        self.on_launch, self.quiet = on_launch, quiet
        self._undo: list[tuple[type, object]] = []

    def __enter__(self) -> TritonLaunches:
        for cls in _runs():
            self._undo.append((cls, cls.__dict__["run"]))
            cls.run = self._wrap(cls.run)
        return self

    def __exit__(self, *exc) -> None:
        for cls, run in reversed(self._undo):
            cls.run = run
        self._undo.clear()

    def _wrap(self, run):
        def launch(kernel, *args, **kwargs):
            if not kwargs.get("warmup"):
                self.on_launch()
            was, self.quiet.on = getattr(self.quiet, "on", False), True
            try:
                return run(kernel, *args, **kwargs)
            finally:
                self.quiet.on = was
        return launch
