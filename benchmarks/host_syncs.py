"""Host synchronisations and kernel launches per training step, counted on CPU (not a test).

    python benchmarks/host_syncs.py -- --precision snip --train-iters 8
    python benchmarks/host_syncs.py --json syncs.json -- --gnmr --precision uniform:fp4
    torchrun --nproc-per-node 2 benchmarks/host_syncs.py -- --tensor-model-parallel-size 2

(rank 0's reads are printed and written.)

On a GPU a step runs at the device's speed only while the host queues kernels ahead of it.
Every read of a device value on the host waits for everything queued before it: ``.item()``,
``float(t)``, ``if t:``, ``.tolist()``, ``.cpu()``, ``nonzero``, a boolean-mask index. A few
reads per step are cheap; one per site or per parameter is not, and on CPU, where a read
costs nothing, it is invisible. So this script trains in its own process, on CPU, under a
``TorchDispatchMode`` that

* follows which tensors would live on the GPU: the model's parameters and gradients, and
  every tensor an op makes or writes from one of them or through a collective (``c10d``);
  a host copy (``.cpu()``) is a host tensor again, as is anything made from host tensors
  only (a step count made by ``torch.tensor(0.0)``);
* counts every op that reads such a tensor on the host (:data:`SYNC_OPS`; ``item`` and
  ``bool`` both end in ``_local_scalar_dense``) and the ``Tensor`` methods that copy to the
  host without an op (:data:`SYNC_METHODS`), each charged to the innermost line of this
  project or of megatron-core that asked, and to the step it happened in (its
  ``before_step`` hooks, the step, its ``on_step`` hooks, validation, checkpointing).

It also counts the kernels a GPU run would launch (``launch_count.py``: an op on device
tensors but a view or an allocation, a collective, a copy between host and device, a
Triton kernel, each charged to its line like a read): where a GPU step waits for its host,
a method's step time follows its launches, not its memory traffic (benchmarks/results/
2026-11-27-host-time.md).

It prints, per step, the reads, the launches and whether the step was logged
(``--log-interval``: a logged step may read more, for its metrics), then the sources of the
median unlogged step's reads and its top launches (:data:`TOP_LAUNCHES`).

On CPU it also follows where a GPU run would place every tensor (``gpu_shadow.py``: the
calls that name a device, moves, factories), counts the blocking copies of host data to the
device (``uploads``: torch waits for the stream after each) and reports each op that would
mix host and device tensors, a crash on a GPU only: the script then exits 1.
``--cuda-branches`` makes device tensors say ``is_cuda``, so the code's GPU side runs (its
Triton kernels in Triton's interpreter).

Limits: code a GPU run does not take (``gpu_shadow.CPU_ONLY``: the formats' amax check reads
on the host only on CPU; STQuant's compiled CPU step) is listed apart (:data:`EXEMPT`);
tensors torch makes in its own code stay unknown; only the main thread is seen (not a
checkpoint writer's). One aten op is one launch: the kernels torch launches inside one op (a
fused optimizer's, a matmul's) are not counted apart. torch's optimizers take their
foreach / fused implementations on CUDA tensors only, so with ``--cuda-branches`` too the
optimizer's launches are its CPU path's (per parameter). On a GPU the script counts reads
and launches (an op launches when a tensor argument or output is on CUDA, no shadow),
beside the synchronising CUDA calls ``torch.cuda.set_sync_debug_mode("warn")`` reports (the
direct check; ``benchmarks/gpu_check.py --sections syncs``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import gpu_shadow  # noqa: E402
import launch_count  # noqa: E402
from gpu_shadow import MIXED, mark  # noqa: E402
from megatron_ext.extension import Extension  # noqa: E402

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten.equal.default, aten.unique_consecutive.default, aten._unique2.default,
            aten.unique_dim.default, aten.repeat_interleave.Tensor}
"""Ops whose result the host must wait for: a value (``item``, ``bool``, ``equal``) or a
data-dependent size (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave``
without ``output_size``). A boolean-mask index is ``index.Tensor`` with a bool index."""
SYNC_METHODS = ("tolist", "numpy", "cpu")
"""``Tensor`` methods that copy to the host without a dispatched op."""
PASSED_THROUGH = str(REPO / "megatron_ext" / "compat" / "cpu.py")
"""The CPU patch's function mode sees every call: its caller is charged instead."""
EXEMPT = {"CPU only": "reads, uploads or mixed-device ops under gpu_shadow.CPU_ONLY"}
"""Reads listed apart and not counted, by why (launches there are dropped)."""


def _exemption(frame) -> str | None:
    """The :data:`EXEMPT` key that covers a read made under ``frame``, if any."""
    return "CPU only" if frame.f_code.co_filename in gpu_shadow.CPU_ONLY else None


def _source() -> tuple[str, str | None]:
    """``path:line function`` of the innermost frame in this project or megatron-core, and
    the :data:`EXEMPT` key that covers the read (None: counted)."""
    frame, source, exempt = sys._getframe(2), "elsewhere", None
    while frame is not None:
        name = frame.f_code.co_filename
        exempt = exempt or _exemption(frame)
        ours = any(p in name for p in gpu_shadow.OUR_CODE) and name != PASSED_THROUGH
        if source == "elsewhere" and ours:
            short = name.split("site-packages/")[-1].replace(str(REPO) + "/", "")
            source = f"{short}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return source, exempt


def on_device(t) -> bool:
    return gpu_shadow.placement(t) is True


def mark_model(chunks: list) -> None:
    """Marks the parameters, their gradients and megatron DDP's contiguous buffers."""
    for chunk in chunks:
        for p in chunk.parameters():
            mark([p, p.grad, getattr(p, "main_grad", None)])
        buffers = getattr(chunk, "buffers", None)
        for b in buffers if isinstance(buffers, list) else []:
            mark([b.grad_data, b.param_data])


def _is_sync(func, args, kwargs) -> bool:
    if func in SYNC_OPS:
        return True
    if func is aten.index.Tensor:  # a boolean mask: its size depends on the values
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return func is aten.repeat_interleave.self_Tensor and kwargs.get("output_size") is None


def _written(func, args, kwargs) -> list:
    """The arguments ``func`` writes in place (``Tensor(a!)`` in its schema)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += value if isinstance(value, (list, tuple)) else [value]
    return out


class SyncCounter(TorchDispatchMode):
    """Counts the main thread's host reads of device tensors and kernel launches by step
    (:meth:`extension` marks the steps and the parameters); on CPU also the blocking uploads
    and the ops a GPU run would refuse for mixing devices (:mod:`gpu_shadow`)."""

    def __init__(self, cuda_branches: bool = False):
        super().__init__()
        self.step = 0  # 0: set-up, before the first step's hooks
        self.reads: dict[int, Counter] = {}  # step -> source -> counted reads
        self.uploads: dict[int, Counter] = {}  # step -> source -> blocking copies to the GPU
        self.launches: dict[int, Counter] = {}  # step -> source -> kernel launches
        self.exempt: dict[int, Counter] = {}  # step -> EXEMPT key -> reads
        self.mixed: dict[int, Counter] = {}  # step -> "source: op(shapes)" -> times
        self.logged: dict[int, bool] = {}
        self._main = threading.main_thread()
        self._originals = {m: getattr(torch.Tensor, m) for m in SYNC_METHODS}
        self._inside = threading.local()  # .on: in a wrapped method or a Triton kernel's
        # run, whose own ops are not counted
        self._triton = launch_count.TritonLaunches(lambda: self.record("launch"), self._inside)
        cuda = self._on_gpu = torch.cuda.is_available()
        self.cuda_syncs: dict[int, Counter] | None = {} if cuda else None
        """On a GPU: step -> source -> the synchronising CUDA calls ``set_sync_debug_mode``
        reports."""
        self._warnings = warnings.catch_warnings()
        self._shadow = None if cuda else gpu_shadow.Shadow(self.record, cuda_branches)

    def record(self, kind: str = "read", what: str = "") -> None:
        if threading.current_thread() is not self._main or getattr(self._inside, "on", False):
            return
        source, exempt = _source()
        if exempt:
            if kind != "launch":
                self.exempt.setdefault(self.step, Counter())[exempt] += 1
        else:
            table = {"read": self.reads, "upload": self.uploads, "launch": self.launches,
                     MIXED: self.mixed}[kind]
            table.setdefault(self.step, Counter())[source + what] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind, where = gpu_shadow.check(func, args, kwargs)
        if kind == MIXED:
            self.record(MIXED, f": {func.name()} of {gpu_shadow.describe(args, kwargs)}")
        elif kind or where and _is_sync(func, args, kwargs):
            self.record(kind or "read")
        out = func(*args, **kwargs)
        if launch_count.is_launch(func, args, kwargs, out, where, self._on_gpu):
            self.record("launch")
        if where is not None:
            mark(pytree.tree_leaves(out), where)
            mark(_written(func, args, kwargs) if func.namespace != "c10d" else
                 [t for t in pytree.tree_leaves(args) if gpu_shadow.placement(t) is None], where)
        return out

    def __enter__(self):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._wrap(name, original))
        if self._shadow is not None:
            self._shadow.__enter__()
        else:  # the direct count, beside this mode's
            self._warnings.__enter__()
            warnings.filterwarnings("always", message=".*synchronizing CUDA")  # each one
            self._shown, warnings.showwarning = warnings.showwarning, self._on_warning
            torch.cuda.set_sync_debug_mode("warn")
        self._triton.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._triton.__exit__(*exc)
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        if self._shadow is not None:
            self._shadow.__exit__(*exc)
        else:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
        return super().__exit__(*exc)

    def _on_warning(self, message, *rest) -> None:
        """``warnings.showwarning`` while counting: the sync warnings are counted, not shown."""
        if "synchronizing CUDA" not in str(message):
            self._shown(message, *rest)
        elif threading.current_thread() is self._main:
            self.cuda_syncs.setdefault(self.step, Counter())[_source()[0]] += 1

    def _wrap(self, name: str, original):
        def method(tensor, *args, **kwargs):
            if not on_device(tensor):
                return original(tensor, *args, **kwargs)
            self.record()
            self.record("launch")  # the copy to the host
            was, self._inside.on = getattr(self._inside, "on", False), True
            try:
                if name == "cpu" and self._shadow is not None:  # on CPU: the tensor itself
                    tensor = tensor.detach().clone()  # a host copy, as on a GPU
                    mark([tensor], False)
                return original(tensor, *args, **kwargs)
            finally:
                self._inside.on = was
        return method

    def extension(self) -> Extension:
        """First in the list: marks the model once it is built (and DDP's buffers once they
        are), opens a step's window before any other hook and notes whether it is logged."""
        def before(args, run, state):
            self.step = state.iteration + 1

        def after(args, run, state):
            self.logged[state.iteration] = bool(run.step_result.get("logged"))

        return Extension(name="host_syncs", after_model=lambda args, chunks: mark_model(chunks),
                         on_train_start=lambda args, run, state: mark_model(run.model),
                         before_step=before, on_step=after)

    def steps(self) -> list[dict]:
        def per_step(table, s):
            return dict(table.get(s, Counter()).most_common())

        return [{"step": s, "logged": logged, "count": sum(self.reads.get(s, {}).values()),
                 "sources": per_step(self.reads, s), "exempt": per_step(self.exempt, s),
                 "launches": sum(self.launches.get(s, {}).values()),
                 "launch_sources": per_step(self.launches, s),
                 **({} if self._shadow is None else {
                     "uploads": sum(self.uploads.get(s, {}).values()),
                     "upload_sources": per_step(self.uploads, s),
                     "mixed": per_step(self.mixed, s)}),
                 **({} if self.cuda_syncs is None else {
                     "cuda_syncs": sum(self.cuda_syncs.get(s, {}).values()),
                     "cuda_sync_sources": per_step(self.cuda_syncs, s)})}
                for s, logged in sorted(self.logged.items())]


def count(train_args: list[str], cuda_branches: bool = False) -> SyncCounter:
    """Train with ``train_args`` in this process under a :class:`SyncCounter` (its
    :meth:`~SyncCounter.steps` give per step ``{"step", "logged", "count", "sources":
    {source: reads}, "exempt": {EXEMPT key: reads}, "launches", "launch_sources"}``, on CPU
    also ``uploads``, ``upload_sources`` and ``mixed``)."""
    from megatron_ext.defaults import default_extensions
    from megatron_ext.training.pretrain import main

    counter = SyncCounter(cuda_branches)
    sys.argv = ["pretrain_llama.py", *train_args]
    with counter:
        status = main("llama", extensions=[counter.extension(), *default_extensions()])
    if status:
        raise SystemExit(f"training failed (exit {status})")
    return counter


TOP_LAUNCHES = 15
"""How many of the median step's launch sources :func:`summary` lists."""


def _median(quiet: list[dict], key: str, noun: str) -> tuple[dict, str]:
    """The median of the unlogged steps by ``key``, and a line saying so."""
    median = sorted(quiet, key=lambda s: s[key])[len(quiet) // 2]
    return median, (f"\nmedian unlogged step ({median['step']}): {median[key]} {noun} "
                    f"(median over the {len(quiet)} unlogged steps: "
                    f"{statistics.median(s[key] for s in quiet):g})")


def summary(steps: list[dict]) -> str:
    cuda, shadow = (bool(steps) and key in steps[0] for key in ("cuda_syncs", "uploads"))
    lines = ["step  logged  host reads    launches" + ("     uploads" if shadow else "")
             + ("  CUDA syncs" if cuda else "") + "  not counted"]
    lines += [f"{s['step']:>4}  {'yes' if s['logged'] else 'no':>6}  {s['count']:>10}  "
              + f"{s['launches']:>10}  " + (f"{s['uploads']:>10}  " if shadow else "")
              + (f"{s['cuda_syncs']:>10}  " if cuda else "")
              + ", ".join(f"{k} {n}" for k, n in s["exempt"].items()) for s in steps]
    quiet = [s for s in steps if not s["logged"]]
    if quiet:
        median, line = _median(quiet, "count", "reads")
        lines.append(line + ", from")
        lines += [f"  {n:>4}  {source}" for source, n in median["sources"].items()]
        lines += [f"  {n:>4}  {source} (upload)"
                  for source, n in median.get("upload_sources", {}).items()]
        median, line = _median(quiet, "launches", "launches")
        sources = list(median["launch_sources"].items())
        lines.append(line + f", the top {min(TOP_LAUNCHES, len(sources))} of {len(sources)} "
                     "sources")
        lines += [f"  {n:>4}  {source}" for source, n in sources[:TOP_LAUNCHES]]
    return "\n".join(lines)


def mixed_report(counter: SyncCounter) -> str:
    """The ops a GPU run would refuse, by step (0: set-up), or "" if none."""
    lines = [f"step {step}: {n} x {what}" for step, table in sorted(counter.mixed.items())
             for what, n in table.items()]
    return "\n".join([f"{len(lines)} op(s) would mix host and device tensors on a GPU:",
                      *lines]) if lines else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, usage="%(prog)s [--json JSON] -- FLAGS",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, help="also write the per-step counts here")
    p.add_argument("--cuda-branches", action="store_true",
                   help="on CPU: device tensors say is_cuda, so the code takes its GPU "
                        "branches (the Triton kernels in Triton's interpreter, slow)")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # torchrun drops the "--"
    args, rest = p.parse_known_args(argv[:cut])
    train_args = rest + argv[cut + 1:]  # pretrain_llama.py's flags (CPU; a --run-dir)
    if args.cuda_branches:  # before any kernel is defined
        if any(m.startswith("megatron_ext.formats") for m in sys.modules):
            raise SystemExit("--cuda-branches: the kernels were imported before the flag")
        os.environ["TRITON_INTERPRET"] = "1"
    counter = count(train_args, args.cuda_branches)
    steps, mixed = counter.steps(), mixed_report(counter)
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary(steps))
        if args.json:
            args.json.write_text(json.dumps(steps, indent=1) + "\n", encoding="utf-8")
    if mixed:
        print(mixed, file=sys.stderr)
    return 1 if mixed else 0


if __name__ == "__main__":
    sys.exit(main())
