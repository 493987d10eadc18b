"""Tensor traffic of PGQ's profile against a training step, counted on CPU (not a test).

    python benchmarks/tensor_traffic.py                       # the shape below, both sum paths
    python benchmarks/tensor_traffic.py --num-layers 4 --hidden-size 1024 ...   # any model flags

A GPU runs the profile's many element-wise operations at memory speed, so their bytes say
what it costs there where no GPU is at hand. This runs ``pretrain_llama.py``'s job in-process
(BF16, ``--precision pgq``, one candidate) under a ``TorchDispatchMode`` that adds up, per
aten op, the bytes of its tensor inputs and outputs (views excluded), the op count and the
GEMM FLOPs — once inside ``collect_profile`` and once inside each ``train_step`` (the step
runs the recipe the profile chose, as the GPU check's PGQ row does). Two calls stand for the
Triton kernels a GPU runs instead of their CPU torch ops: ``quantize`` (the profile's and
the quantized GEMMs') counts three passes over its operand (the two-pass plan; a one-pass
format makes two) and ``error_sums`` one read of ``t`` and ``q``. ``--sums reference``
counts the float64 torch ops instead (what the GPU ran before the Triton pass).

Caveats: a model of memory traffic, not a timing — caching, fusion inside one aten op and
launch latency are not in it; the GPU's measurement is ``benchmarks/gpu_check.py``'s ``pgq``
row.
"""

from __future__ import annotations

import argparse
import collections
import sys
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, _disable_current_modes,
                                          _get_current_dispatch_mode)
from torch.utils._pytree import tree_flatten

MODEL = ["--num-layers", "2", "--hidden-size", "512", "--ffn-hidden-size", "1408",
         "--num-attention-heads", "8", "--seq-length", "256", "--max-position-embeddings", "256",
         "--micro-batch-size", "4", "--global-batch-size", "4", "--mock-data", "--bf16"]
"""The default model flags (the run adds its own)."""
RUN = ["--train-iters", "2", "--eval-iters", "0", "--no-save", "--log-interval", "100"]
GEMMS = ("mm", "addmm", "bmm")
SKIP = ("detach", "alias", "lift_fresh")


class Traffic(TorchDispatchMode):
    """Bytes, calls and GEMM FLOPs of every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in SKIP:
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.add(name, sum(t.numel() * t.element_size() for t in tensors))
        if name in GEMMS:
            a, b = [t for t in args if isinstance(t, torch.Tensor)][-2:]
            self.flops += 2 * a.numel() * b.shape[-1]
        return out

    def add(self, name: str, nbytes: int) -> None:
        self.bytes[name] += nbytes
        self.calls[name] += 1


def as_kernel(fn, name: str, passes):
    """``fn`` run outside the counting, counted as ``passes(*args)`` bytes under ``name``."""

    def counted(*args, **kwargs):
        mode = _get_current_dispatch_mode()
        with _disable_current_modes():
            out = fn(*args, **kwargs)
        if isinstance(mode, Traffic):
            mode.add(name, passes(*args))
        return out

    return counted


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextmanager
def instrument(sums: str):
    """Count ``collect_profile`` and ``train_step`` inside the block, with the Triton
    stand-ins (module docstring); yields ``{"profile": [...], "step": [...]}``."""
    import megatron_ext.methods.pgq.extension as pgq_ext
    import megatron_ext.methods.pgq.sqnr as sqnr
    import megatron_ext.precision.gemm as gemm
    import megatron_ext.training.loop as loop

    counts: dict[str, list[Traffic]] = {"profile": [], "step": []}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            traffic = Traffic()
            with traffic:
                out = fn(*args, **kwargs)
            counts[key].append(traffic)
            return out
        return wrapper

    quantize = as_kernel(gemm.quantize, "quantize (3 passes)", lambda t, *a, **k: 3 * _nbytes(t))
    patches = [(gemm, "quantize", quantize), (sqnr, "quantize", quantize),
               (pgq_ext, "collect_profile", counted(pgq_ext.collect_profile, "profile")),
               (loop, "train_step", counted(loop.train_step, "step"))]
    if sums == "kernel":
        patches.append((sqnr, "error_sums", as_kernel(sqnr.error_sums, "error_sums (1 pass)",
                                                      lambda t, q, *_: _nbytes(t) + _nbytes(q))))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield counts
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def run(model_args: list[str], sums: str) -> dict:
    """Train briefly with PGQ under the counters; GB, ops and GFLOP per profiled batch and per
    step."""
    from megatron_ext.defaults import default_extensions
    from megatron_ext.training.pretrain import main

    argv, sys.argv = sys.argv, ["pretrain_llama.py", *model_args, *RUN, "--precision", "pgq"]
    try:
        with instrument(sums) as counts:
            main("llama", extensions=default_extensions())
    finally:
        sys.argv = argv
    profile, step = counts["profile"][0], counts["step"][-1]
    batches = 2  # --pgq-profile-steps' default
    out = {}
    for key, t, per in (("profile batch", profile, batches), ("step", step, 1)):
        out[key] = {"GB": sum(t.bytes.values()) / 1e9 / per, "ops": sum(t.calls.values()) / per,
                    "GFLOP": t.flops / 1e9 / per,
                    "top": [(n, b / 1e9 / per) for n, b in t.bytes.most_common(6)]}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sums", choices=("kernel", "reference"), default="kernel",
                        help="count error_sums as its one Triton pass (kernel, default) or as "
                             "the float64 torch ops of the reference path (reference)")
    args, model = parser.parse_known_args(argv)
    result = run(model or MODEL, args.sums)
    for key, r in result.items():
        top = ", ".join(f"{n} {gb:.3f}" for n, gb in r["top"])
        print(f"{key:>14}: {r['GB']:.3f} GB, {r['ops']:.0f} ops, {r['GFLOP']:.2f} GFLOP | {top}")
    ratio = result["profile batch"]["GB"] / result["step"]["GB"]
    print(f"profile batch / step traffic: {ratio:.2f}x (sums: {args.sums})")


if __name__ == "__main__":
    main()
