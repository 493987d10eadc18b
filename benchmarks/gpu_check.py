"""One command that checks this project on a GPU and measures what only a GPU can show.

    python benchmarks/gpu_check.py --out gpu_check          # everything, ~8 min on one H100
    python benchmarks/gpu_check.py --sections gemm train    # a subset

Sections, in this order (each one's failure is recorded and the next one runs):

* ``env``      python, torch, CUDA, triton, megatron-core, the card, Transformer Engine;
* ``main``     the main job (``pretrain_llama.py``, tiny Llama) for ``--main-steps`` steps;
* ``formats``  every format's GPU path (``benchmarks/quantize.py``, 8192 x 8192, FP32 and BF16)
               and the FP8 scale-and-cast kernel (4096 x 4096): bit-identical with the CPU
               reference, and time against ``clone()`` (target <= 3x);
* ``stquant``  STQuant's fused Triton step against torch's AdamW at TinyLlama's widths x 8
               layers (``benchmarks/stquant_step.py``; target <= 1.5x) and against the CPU path;
* ``gemm``     real FP8 GEMMs (``torch._scaled_mm``: per tensor, per row, 1x128 x 128x128
               blocks) and the emulated ones (FP8 blocks, MXFP4, NVFP4) against a BF16 matmul
               at TinyLlama-1.1B's GEMM shapes, with and without quantizing the operands;
               writes the measured device profile ``<out>/device_profile.json``
               (``--device-profile FILE``; docs/cost_model.md);
* ``train``    tokens/s and peak memory at the TinyLlama-1.1B shape (22 layers, seq 2048,
               micro-batch 2, mock data) for BF16, uniform:fp8 real and emulated, and the
               methods (snip, gnmr, stquant, gaussws, pgq); the snip row also gives its
               refresh step's peak memory over a normal step's (``benchmarks/snip_memory.py``,
               target <= 1.15x);
* ``profile``  ``torch.profiler`` over ``--profile-steps`` steps at the TinyLlama-1.1B shape
               (BF16 and per-tensor FP8 real): device time per kernel group (GEMM,
               attention, norm, elementwise, quantize, optimizer, communication, other),
               launches per step, host gaps, the dry run's GEMM estimate beside
               (``benchmarks/gpu_profile.py``);
* ``pytest``   ``pytest tests/unit`` with CUDA visible (xdist, ``--pytest-timeout`` seconds).

It prints each result as it comes and writes ``<out>/gpu_check.json`` and
``<out>/gpu_check.md`` (the table BENCHMARKS.md takes). Nothing is downloaded. On a machine
without network where megatron-core / highspy are missing, bring their wheels
(``docs/gpu.md``). Without a GPU it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SECTIONS = ("env", "main", "formats", "stquant", "gemm", "train", "syncs", "profile", "pytest")
GEMM_SHAPES = [(8192, 2048, 5632), (8192, 5632, 2048), (8192, 2048, 2048), (16384, 8192, 8192)]
"""(M, K, N) of ``(M, K) @ (K, N)``: TinyLlama-1.1B's fc1 / fc2 / proj at 8192 tokens, and a
large square one."""
TRAIN_CONFIGS = {
    "bf16": [],
    "bf16 micro-batch 8 global 64": ["--micro-batch-size", "8", "--global-batch-size", "64"],
    "fp8 per-tensor real micro-batch 8 global 64": [
        "--precision", "uniform:fp8_e4m3", "--fp8-execution", "real",
        "--micro-batch-size", "8", "--global-batch-size", "64"],
    "uniform:fp8 real": ["--precision", "uniform:fp8", "--fp8-execution", "real"],
    "uniform:fp8 emulated": ["--precision", "uniform:fp8", "--fp8-execution", "emulated"],
    "fp8 per-tensor real": ["--precision-plan", "{fp8_tensor_plan}", "--fp8-execution", "real"],
    "fp8 per-tensor emulated": ["--precision-plan", "{fp8_tensor_plan}",
                                "--fp8-execution", "emulated"],
    "snip": ["--precision", "snip", "--snip-budget", "0.5", "--snip-start", "3",
             "--snip-interval", "3", "--snip-apply-lag", "1"],
    "gnmr": ["--precision", "uniform:fp8", "--gnmr"],
    "stquant": ["--optimizer", "stquant-adamw"],
    "gaussws": ["--gaussws", "od"],
    "gaussws lambda 0": ["--gaussws", "od", "--gaussws-lambda", "0"],
    "pgq": ["--precision", "pgq"],
    "pgq plan": ["--precision-plan", "{pgq_plan}"],
    "snip plan": ["--precision-plan", "{snip_plan}"],
    "bf16 1 sequence": ["--micro-batch-size", "1", "--global-batch-size", "1"],
    "gaussws 1 sequence": ["--gaussws", "od", "--micro-batch-size", "1",
                           "--global-batch-size", "1"],
    "bf16 hidden 4096": ["--model", "llama2-7b", "--num-layers", "8"],
    "fp8 per-tensor real hidden 4096": ["--model", "llama2-7b", "--num-layers", "8",
                                        "--precision", "uniform:fp8_e4m3",
                                        "--fp8-execution", "real"],
    "uniform:fp8 real hidden 4096": ["--model", "llama2-7b", "--num-layers", "8",
                                     "--precision", "uniform:fp8", "--fp8-execution", "real"],
    "uniform:fp8 real 2 micro-batches": ["--precision", "uniform:fp8", "--fp8-execution", "real",
                                         "--micro-batch-size", "1"],
    "uniform:fp8 real 2 micro-batches no cache": [
        "--precision", "uniform:fp8", "--fp8-execution", "real", "--micro-batch-size", "1",
        "--no-cache-quantized-weights"],
}
"""``--precision`` etc. per training row on :data:`TRAIN_SHAPE` (:func:`row_flags`: a flag
the shape names takes the row's value; ``micro-batch 8 global 64`` is the batch TinyLlama
trained with, 131,072 tokens a step in 8 micro-batches; the ``1 sequence`` rows halve the
tokens a step: a step whose time stays is the host's, not the GPU's; the ``2 micro-batches``
rows, the same tokens in two micro-batches, with the FP8 weights made once per step and in
each GEMM; the ``hidden 4096`` rows, Llama-2-7B's widths at 8 layers: per-tensor FP8's target
there is 1.25x BF16, 1.12x at TinyLlama's);
``{fp8_tensor_plan}`` is a plan file with every site in per-tensor E4M3; ``{pgq_plan}`` /
``{snip_plan}`` is the last plan the ``pgq`` / ``snip`` row wrote (run that row first): the
method's overhead is its step time over its own plan's through ``--precision-plan``."""
SYNC_CONFIGS = {
    "uniform:fp8": ["--precision", "uniform:fp8"],
    "snip + gnmr + stquant + gaussws": ["--precision", "snip", "--snip-start", "3",
                                        "--snip-interval", "0", "--gnmr", "--optimizer",
                                        "stquant-adamw", "--gaussws", "od"],
    "pgq": ["--precision", "pgq"],
}
"""``--precision`` etc. per row of the ``syncs`` section (``benchmarks/host_syncs.py`` at
:data:`SYNC_SHAPE`: its CPU-side count of host reads beside CUDA's own count)."""
SYNC_SHAPE = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
              "--seq-length", "64", "--lr-warmup-iters", "1", "--eval-iters", "0",
              "--train-iters", "6", "--log-interval", "100", "--no-save"]
TRAIN_SHAPE = ["--model", "tinyllama-1.1b", "--mock-data", "--micro-batch-size", "2",
               "--global-batch-size", "2", "--seq-length", "2048", "--eval-iters", "0",
               "--no-save", "--log-interval", "1"]


def row_flags(flags: list[str]) -> list[str]:
    """:data:`TRAIN_SHAPE` with a training row's flags: a ``--flag value`` the shape names
    replaces the shape's value, the rest are appended (the project refuses a flag twice)."""
    shape, rest, i = list(TRAIN_SHAPE), [], 0
    while i < len(flags):
        if flags[i] in shape and i + 1 < len(flags):
            shape[shape.index(flags[i]) + 1] = flags[i + 1]
            i += 2
        else:
            rest.append(flags[i])
            i += 1
    return shape + rest


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check", help="output folder (default ./gpu_check)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="which sections to run (default: all)")
    p.add_argument("--train-steps", type=int, default=10,
                   help="steps per training row; the median of those after step 3 is kept")
    p.add_argument("--train-configs", nargs="+", choices=list(TRAIN_CONFIGS),
                   default=list(TRAIN_CONFIGS), help="training rows to run (default: all)")
    p.add_argument("--formats-budget", type=float, default=60.0,
                   help="seconds for the formats section's timed rows (those left are skipped)")
    p.add_argument("--main-steps", type=int, default=50, help="steps of the main job")
    p.add_argument("--sync-configs", nargs="+", choices=list(SYNC_CONFIGS),
                   default=list(SYNC_CONFIGS), help="rows of the syncs section (default: all)")
    p.add_argument("--profile-warmup", type=int, default=3,
                   help="steps each profile row trains before the profiled ones")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="steps each profile row profiles (torch.profiler, CUDA kernels)")
    p.add_argument("--pytest-timeout", type=int, default=200,
                   help="seconds for pytest (killed after)")
    p.add_argument("--pytest-paths", nargs="+", default=["tests/unit"],
                   help="what the pytest section runs (default tests/unit)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: benchmarks/gpu_check.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks import gpu_sections

    results = {}
    for name in args.sections:
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            results[name] = getattr(gpu_sections, name)(args, out)
        except Exception as exc:  # one section's failure is a result, not the end of the check
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        results[name + "_seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(results[name], indent=1)[:4000], flush=True)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    (out / "gpu_check.md").write_text(gpu_sections.markdown(results))
    print((out / "gpu_check.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
