"""The ``profile`` section of ``benchmarks/gpu_check.py``: where a training step's GPU time goes.

For each row of :data:`PROFILE_CONFIGS` (BF16, per-tensor FP8 real) at the TinyLlama-1.1B
shape, this file, run as a worker (``python benchmarks/gpu_profile.py --trace T --warmup W
--steps N -- <pretrain flags>``), trains ``W`` steps, then ``N`` more under
``torch.profiler`` (CUDA activity), and writes every kernel of those ``N`` steps (name, start,
duration) to ``T``. The section then groups the kernels by what they are (:func:`classify`:
GEMM, attention, norm, elementwise, quantize, optimizer, communication, other) into a table
(:func:`profile_table`): device ms per step, share, launches per step and the longest kernel
of each group; the device's busy time, the span of the steps and the host gaps between them
(the span the device sat idle); and beside the GEMM row the project's own prediction, the dry
run's step time (GEMMs and attention core at the card's BF16 peak, FP8 at twice it: a lower
bound). Others have no prediction ("-").
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GROUPS = ("GEMM", "attention", "norm", "elementwise", "quantize", "optimizer", "communication",
          "other")
_RULES = [  # first match wins: names of attention kernels hold "cutlass", of FP8 GEMMs "e4m3"
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|sendrecv"),
    ("optimizer", r"multi_tensor_apply|adam|foreach|lpnorm|_step_kernel"),
    ("attention", r"flash|fmha|attention|sdpa|softmax_warp"),
    ("GEMM", r"gemm|cutlass|cublas|xmma|nvjet|wgmma|matmul|aten::(mm|addmm|bmm)$"),
    ("quantize", r"quant|amax|scale_cast|float8|fp8|e4m3|e5m2"),
    ("norm", r"norm|rms|RowwiseMoments"),
    ("elementwise", r"elementwise|triton_poi|triton_red|reduce_kernel|vectorized|aten::"),
]
PROFILE_CONFIGS = {
    "bf16": [],
    "fp8 per-tensor real": ["--precision-plan", "{fp8_tensor_plan}", "--fp8-execution", "real"],
}
"""Rows of the section (as ``gpu_check.TRAIN_CONFIGS``' rows, on its ``TRAIN_SHAPE``)."""


def classify(name: str) -> str:
    """The group of a kernel (or, on a CPU trace, an aten op) by its name."""
    for group, pattern in _RULES:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


@dataclass(frozen=True)
class Kernel:
    """One kernel launch (or operator) of a profiler trace."""

    name: str
    start_us: float
    """Start on the trace's clock (microseconds)."""
    dur_us: float
    """Duration in microseconds."""


def trace_kernels(trace: dict, category: str = "kernel") -> list[Kernel]:
    """The events of ``category`` in a chrome trace (``export_chrome_trace``'s JSON): CUDA
    kernels by default, ``cpu_op`` for a CPU-only trace."""
    return [Kernel(e["name"], float(e["ts"]), float(e.get("dur", 0.0)))
            for e in trace.get("traceEvents", []) if e.get("cat") == category]


def busy_us(kernels: list[Kernel]) -> float:
    """Microseconds at least one of ``kernels`` runs (overlapping ones counted once)."""
    busy, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_us):
        start, stop = max(k.start_us, end), k.start_us + k.dur_us
        if stop > start:
            busy += stop - start
        end = max(end, stop)
    return busy


def profile_table(kernels: list[Kernel], steps: int, predictions: dict | None = None) -> dict:
    """Per group: device ms per step, share of the device time, launches per step, the
    group's longest kernel, the prediction (``predictions[group]``, else "-"); and the totals:
    busy and span ms per step, host gaps (span - busy) and launches per step."""
    predictions = predictions or {}
    total = sum(k.dur_us for k in kernels) or 1.0
    rows = []
    for group in GROUPS:
        mine = [k for k in kernels if classify(k.name) == group]
        if not mine:
            continue
        longest = max(mine, key=lambda k: k.dur_us).name
        rows.append({"group": group,
                     "ms/step": round(sum(k.dur_us for k in mine) / steps / 1e3, 3),
                     "share": f"{100 * sum(k.dur_us for k in mine) / total:.1f}%",
                     "launches/step": round(len(mine) / steps, 1),
                     "longest kernel": longest[:90],
                     "prediction": predictions.get(group, "-")})
    span = (max(k.start_us + k.dur_us for k in kernels) - min(k.start_us for k in kernels)
            if kernels else 0.0)
    busy = busy_us(kernels)
    return {"rows": rows, "busy ms/step": round(busy / steps / 1e3, 3),
            "span ms/step": round(span / steps / 1e3, 3),
            "host gaps ms/step": round((span - busy) / steps / 1e3, 3),
            "launches/step": round(len(kernels) / steps, 1)}


def _dry_run_ms(flags: list[str], out: Path) -> str:
    """The dry run's step time for ``flags`` (milliseconds, as text), or why there is none."""
    path = out / "dry_run.json"
    cmd = [sys.executable, str(REPO / "pretrain_llama.py"), *flags, "--dry-run",
           "--dry-run-json", str(path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not path.exists():
        return "-"
    seconds = json.loads(path.read_text())["step_seconds"]
    return f"{1e3 * seconds:.1f} (dry run: GEMMs + attention core)"


def profile(args, out: Path) -> dict:
    """The section: one table per row of :data:`PROFILE_CONFIGS` (module docstring)."""
    from benchmarks.gpu_check import row_flags
    from benchmarks.gpu_sections import fp8_tensor_plan

    plan = fp8_tensor_plan(out)
    tables = {}
    for name, row in PROFILE_CONFIGS.items():
        run_dir = out / ("profile_" + "".join(c if c.isalnum() else "_" for c in name))
        run_dir.mkdir(parents=True, exist_ok=True)
        flags = row_flags([f.format(fp8_tensor_plan=plan) for f in row])
        trace = run_dir / "kernels.json"
        cmd = [sys.executable, str(Path(__file__)), "--trace", str(trace), "--warmup",
               str(args.profile_warmup), "--steps", str(args.profile_steps), "--", *flags,
               "--run-dir", str(run_dir / "run"),
               "--train-iters", str(args.profile_warmup + args.profile_steps)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0 or not trace.exists():
            tables[name] = {"error": (proc.stdout[-800:] + proc.stderr[-1500:]).strip()}
            continue
        kernels = [Kernel(*k) for k in json.loads(trace.read_text())]
        tables[name] = profile_table(kernels, args.profile_steps,
                                     {"GEMM": _dry_run_ms(flags, run_dir)})
    return {"tables": tables}


def markdown(section: dict) -> list[str]:
    """The section's tables as markdown lines."""
    lines = []
    for name, table in section.get("tables", {}).items():
        if "error" in table:
            lines += [f"profile {name}: error {table['error'][-300:]}", ""]
            continue
        keys = list(table["rows"][0]) if table["rows"] else []
        lines += [f"### profile: {name}", "",
                  " | ".join(f"{k} {v}" for k, v in table.items() if k != "rows"), "",
                  "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in table["rows"]]
        lines.append("")
    return lines


def _profiler_extension(first: int, steps: int, trace: Path):
    """An extension that profiles steps ``first`` .. ``first + steps - 1`` and writes their
    CUDA kernels (on a machine without CUDA: the CPU operators) to ``trace`` as
    ``[name, start_us, dur_us]`` lists."""
    import torch
    from torch.profiler import ProfilerActivity

    from megatron_ext.extension import Extension

    cuda = torch.cuda.is_available()
    activity, category = (ProfilerActivity.CUDA, "kernel") if cuda else (ProfilerActivity.CPU,
                                                                          "cpu_op")
    active = []

    def before_step(args, run, state):
        if state.iteration + 1 == first:
            torch.cuda.synchronize()
            active.append(torch.profiler.profile(activities=[activity]))
            active[0].__enter__()

    def on_step(args, run, state):
        if active and state.iteration == first + steps - 1:
            torch.cuda.synchronize()
            active[0].__exit__(None, None, None)
            raw = trace.with_suffix(".trace.json")
            active[0].export_chrome_trace(str(raw))
            kernels = trace_kernels(json.loads(raw.read_text()), category)
            trace.write_text(json.dumps([[k.name, k.start_us, k.dur_us] for k in kernels]))
            raw.unlink()
        return None

    return lambda controller: Extension("gpu_profile", before_step=before_step,
                                        on_step=on_step)


def _worker(argv: list[str]) -> int:
    """``--trace T --warmup W --steps N -- <pretrain flags>``: train with the profiler."""
    import argparse

    sys.path.insert(0, str(REPO))
    from megatron_ext.defaults import default_extensions
    from megatron_ext.training.pretrain import main

    split = argv.index("--")
    p = argparse.ArgumentParser(description="profile a few training steps (gpu_check)")
    p.add_argument("--trace", type=Path, required=True, help="where the kernels go (JSON)")
    p.add_argument("--warmup", type=int, required=True, help="steps before the profiled ones")
    p.add_argument("--steps", type=int, required=True, help="profiled steps")
    own = p.parse_args(argv[:split])
    sys.argv = [sys.argv[0], *argv[split + 1:]]
    extension = _profiler_extension(own.warmup + 1, own.steps, own.trace)
    return main("llama", extensions=default_extensions(extension))


if __name__ == "__main__":  # dist_checkpointing spawns workers that re-import this file
    sys.exit(_worker(sys.argv[1:]))
