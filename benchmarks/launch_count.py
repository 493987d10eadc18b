"""Which calls launch a GPU kernel, for ``host_syncs.py``'s per-step count of launches, and
the launches per quantized GEMM of one linear with real FP8 GEMMs:

    python benchmarks/launch_count.py [--formats fp8_e4m3 fp8_e4m3@row] [--micro-batches 4]

prints, per format, with and without the weight cache, a table of launches per micro-batch
by GEMM kind (fprop, dgrad, wgrad, the weights' quantization, the rest), counted over one
step after a warm-up step (:func:`gemm_launches`; on CPU the quantizers take their GPU side
in Triton's interpreter, every dispatched op but views and allocations one launch).

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

import argparse
import contextlib
import json
import os
import sys
import threading
from collections import Counter
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

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


# --- launches per quantized GEMM --------------------------------------------------------

GEMM_FRAMES = {"_dgrad": "dgrad", "_wgrad": "wgrad", "forward": "fprop", "backward": "other"}
"""Function of ``precision/gemm.py`` on the stack -> the GEMM kind a launch belongs to
(innermost first; ``backward`` alone: the bias gradient, ``dy``'s copy)."""
WEIGHT_FRAMES = {"_fp8_fprop_weight", "_fp8_dgrad_weight"}
"""Functions of ``precision/gemm.py`` that make a real GEMM's FP8 weight (once a step with the
weight cache): their launches are the kind ``weights``."""
KINDS = ("fprop", "dgrad", "wgrad", "weights", "other")


def _gemm_kind() -> str:
    """The GEMM kind of the launch being made, from the Python stack."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(os.path.join("precision", "gemm.py")):
            if code.co_name in WEIGHT_FRAMES:
                return "weights"
            if code.co_name in GEMM_FRAMES:
                return GEMM_FRAMES[code.co_name]
        frame = frame.f_back
    return "other"


class GemmLaunches(TorchDispatchMode):
    """In a ``with`` block: launches by GEMM kind (:data:`KINDS`), every dispatched op on any
    tensor a launch (the micro-run holds device tensors only) but views and :data:`NO_KERNEL`,
    and every Triton kernel run (:class:`TritonLaunches`)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()
        self._quiet = threading.local()
        self._triton = TritonLaunches(self._count, self._quiet)

    def _count(self) -> None:
        if not getattr(self._quiet, "on", False):
            self.counts[_gemm_kind()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func.overloadpacket not in NO_KERNEL:
            self._count()
        return out

    def __enter__(self):
        self._triton.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._triton.__exit__(*exc)


class _CudaBranches:
    """On CPU, in a ``with`` block: every tensor says ``is_cuda``, so the quantizers take
    their GPU side (Triton kernels, in Triton's interpreter)."""

    def __enter__(self):
        self._was = torch.Tensor.__dict__.get("is_cuda")
        torch.Tensor.is_cuda = property(lambda t: True)
        return self

    def __exit__(self, *exc):
        if self._was is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = self._was


def gemm_launches(formats: str, micro_batches: int, cached: bool, shape=(64, 128, 96),
                  device: str = "cpu") -> dict[str, float]:
    """Launches per micro-batch by GEMM kind of one linear (``T, K, N = shape``) in
    ``formats`` (one format for ``x``, ``w`` and ``dy``), real FP8 GEMMs, over one step of
    ``micro_batches`` forwards and backwards, with the weight cache (``cached``) or without
    (every GEMM quantizes its weight from BF16)."""
    from megatron_ext.precision.gemm import quantized_gemm
    from megatron_ext.precision.site_formats import SiteFormats, resolve
    from megatron_ext.precision.weight_cache import WeightCache, WeightReuse

    tokens, k, n = shape
    ops = resolve(SiteFormats(formats, formats, formats))
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype).requires_grad_()
    data = [(torch.randn(tokens, k, generator=g).to(device, dtype).requires_grad_(),
             torch.randn(tokens, n, generator=g).to(device, dtype))
            for _ in range(micro_batches)]
    reuse = WeightReuse(micro_batches)
    cache = WeightCache(reuse) if cached else None
    counter = GemmLaunches()
    branches = _CudaBranches() if device == "cpu" else contextlib.nullcontext()
    for counted in (contextlib.nullcontext(), counter):  # a warm-up step: the device trials
        reuse.new_weights()
        with branches, counted:
            for x, dy in data:
                if cache is not None:
                    cache.start_forward()
                w.grad = x.grad = None  # the count leaves out the gradients' accumulation
                quantized_gemm(x, w, None, ops, real=True, cache=cache).backward(dy)
    per_micro = {kind: counter.counts[kind] / micro_batches for kind in KINDS}
    return {**per_micro, "total": sum(per_micro.values())}


def table(rows: dict[str, dict[str, float]]) -> str:
    """A markdown table: one row per configuration, launches per micro-batch by kind."""
    head = ["configuration", *KINDS, "total"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, counts in rows.items():
        lines.append("| " + " | ".join([name, *(f"{counts[c]:g}" for c in head[1:])]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Launches per quantized GEMM of one linear, "
                                "real FP8 GEMMs, per micro-batch by GEMM kind (fprop, dgrad, "
                                "wgrad, the weights' quantization, the rest), with and "
                                "without the weight cache. On CPU the quantizers take their "
                                "GPU side in Triton's interpreter.")
    p.add_argument("--formats", nargs="+", default=["fp8_e4m3", "fp8_e4m3@row"],
                   help="FP8 formats, each used for x, w and dy (default: per tensor, per row)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches of the step")
    p.add_argument("--json", type=Path, help="also write the counts here")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = {f"{fmt}, {'cached' if cached else 'no cache'}":
            gemm_launches(fmt, args.micro_batches, cached, device=device)
            for fmt in args.formats for cached in (True, False)}
    print(f"launches per micro-batch ({args.micro_batches} micro-batches a step, {device})")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():  # before any kernel is defined
        os.environ["TRITON_INTERPRET"] = "1"
    sys.exit(main())
