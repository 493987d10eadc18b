"""Host time of a training step per method, on CPU at a GPU run's depth (not a test).

    nice -n 10 python benchmarks/host_time.py                       # 3 rounds, 30 steps
    nice -n 10 python benchmarks/host_time.py --runs plain "gaussws od" --rounds 5

On a GPU the host queues every kernel: Python, the dispatcher, a launch. When a step's
host work outlasts its kernels, the GPU waits, and a method's extra host work per layer
and site adds to the step time whatever its kernels cost. TinyLlama-1.1B's 22 layers at
4,096 tokens a step on an H200 are in that regime for the methods' small per-site ops
(benchmarks/results/2026-11-27-host-time.md). This script trains a Llama of the same depth, 22
layers, at widths so small that the kernels take next to nothing on CPU (hidden 64, 32
tokens a step): its step time is nearly all host work, the part of a GPU step that does
not shrink with a faster GPU. It runs each method's flags (:data:`RUNS`) as a child
process (``gaussws_overhead.py``'s ``--train`` machinery: one thread, ``--rounds`` rounds
interleaved, the median over steps after ``--skip``) and prints each run's CPU time per
step against the plain run's.

``--quantizers`` times instead the host's own Python per call of the formats' GPU path
(``formats.fake_quant`` on a CUDA tensor: plan, arguments, allocation), one call per
quantized GEMM operand, six per site and micro-batch: on CPU, with the Triton path forced
and each kernel launch stubbed out (counted, not run), so Triton's own launcher is not in
it (a GPU's ``gpu_check --sections syncs`` times whole calls).

Caveat: on CPU the code takes its CPU paths. Where the GPU's differs (the formats' and
GaussWS's Triton kernels are one launch where the torch path is a dozen ops; torch's
optimizers run per parameter on CPU and multi-tensor on CUDA) the CPU's host work is
larger; ``benchmarks/host_syncs.py --cuda-branches`` counts the GPU side's launches.
"""

from __future__ import annotations

import argparse
import sys

from gaussws_overhead import CHILD, pretrain_child, train_step_times

from megatron_ext.errors import UsageError, run_cli
from megatron_ext.io import write_json_atomic

DEPTH = ["--num-layers", "22", "--hidden-size", "64", "--ffn-hidden-size", "176",
         "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "1", "--global-batch-size", "1", "--mock-data"]
"""TinyLlama-1.1B's 22 layers at tiny widths and one 32-token sequence a step."""
RUNS = {
    "plain": [],
    "gaussws od": ["--gaussws", "od"],
    "gaussws od lambda 0": ["--gaussws", "od", "--gaussws-lambda", "0"],
    "stquant-adamw": ["--optimizer", "stquant-adamw"],
}
"""Flags per run on top of :data:`DEPTH` (``plain``: BF16's code path, no method)."""


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS),
                   help="which runs (default: all; plain is always run, the ratios' base)")
    p.add_argument("--train-iters", type=int, default=30, help="steps per run (default 30)")
    p.add_argument("--skip", type=int, default=8,
                   help="warm-up steps left out of a run's median (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--json", default=None, help="also write the per-round medians here")
    p.add_argument("--quantizers", action="store_true",
                   help="time the formats' GPU-path Python per call instead (module docstring)")
    args = p.parse_args(argv)
    if args.rounds < 1 or not 0 <= args.skip < args.train_iters:
        raise UsageError("--rounds must be positive and --skip in [0, --train-iters)")
    return args


QUANTIZERS = ("fp8_e4m3@tile128", "fp8_e4m3@block128", "int8@row", "fp8_e4m3", "fp4_e2m1",
              "mxfp4", "nvfp4")
"""Formats of ``--quantizers``: ``uniform:fp8``'s two, PGQ's recipe, per tensor, MX, NVFP4."""


def quantizer_host_us(calls: int = 2000) -> dict[str, tuple[float, int]]:
    """Format -> (host µs per ``fake_quant`` call on the GPU path, kernels it launches), a
    32 x 2048 BFloat16 operand, the launches stubbed out (module docstring)."""
    import timeit

    import torch
    from triton.runtime.jit import JITFunction

    from megatron_ext.formats import get_format, pipeline

    launches, run, backend = [], JITFunction.run, pipeline.triton_backend
    JITFunction.run = lambda *a, **k: launches.append(1)
    pipeline.triton_backend = lambda x: True
    x = torch.randn(32, 2048).bfloat16()
    try:
        out = {}
        for name in QUANTIZERS:
            fmt = get_format(name)
            launches.clear()
            pipeline.fake_quant(x, fmt)
            count = len(launches)
            seconds = min(timeit.repeat(lambda: pipeline.fake_quant(x, fmt), number=calls,
                                        repeat=3)) / calls
            out[name] = (round(seconds * 1e6, 1), count)
    finally:
        JITFunction.run, pipeline.triton_backend = run, backend
    return out


def run(argv) -> None:
    args = parse_args(argv)
    if args.quantizers:
        results = quantizer_host_us()
        print("format               host us / call  kernels (the formats' GPU path, on CPU, "
              "launches stubbed)")
        for name, (us, kernels) in results.items():
            print(f"{name:20} {us:14.1f}  {kernels:7d}")
        if args.json:
            write_json_atomic(args.json, {"args": vars(args), "host_us_per_call": results})
        return
    names = ["plain", *(n for n in args.runs if n != "plain")]
    runs = {n: [*DEPTH, *RUNS[n]] for n in names}
    results = train_step_times(args, runs, __file__,
                               model="Llama of 22 layers at hidden 64, 32 tokens a step")
    if args.json:
        write_json_atomic(args.json, {"args": vars(args), "step_time_s": results})


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:  # one run, in a child process
        raise SystemExit(pretrain_child())
    raise SystemExit(run_cli(run))
