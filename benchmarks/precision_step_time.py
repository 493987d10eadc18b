"""Step time of emulated low-precision training relative to the unquantized run (not a test).

    python benchmarks/precision_step_time.py                    # tiny Llama, 30 steps, 3 rounds
    python benchmarks/precision_step_time.py --models tiny wide --repeats 2
    python benchmarks/precision_step_time.py --micro-batch-size 1 \
        --runs fp32 uniform:fp8 "uniform:fp8 --no-cache-quantized-weights"

For each model, trains ``fp32`` (megatron's own linears) and each ``--precision`` run for
``--train-iters`` steps (8 sequences a step, in micro-batches of ``--micro-batch-size``;
a run is a ``--precision`` value, then any more flags), ``--repeats`` rounds interleaved (so that load from other jobs hits
every run alike), and prints the median step time (steps after the first ``--skip``), its
ratio to ``fp32`` and the run's peak memory (``mem_gib``: peak RSS on CPU, the allocator's
peak on a GPU; the largest over the rounds). On a CPU the quantized runs can only be slower: fake quantization adds
memory-bound passes over every GEMM operand (5 per site and step with 128x128-block weights:
x twice, w once, dy twice) and saves no GEMM time. ``wide`` has 4x the hidden size of
``tiny``: GEMM work grows with N*K per token, quantization with N + K, so the ratio shrinks.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from precision_quality import precision_flags, train

MODELS = {
    "tiny": [],
    "wide": ["--hidden-size", "512", "--ffn-hidden-size", "1408", "--num-attention-heads", "8",
             "--num-query-groups", "4"],
}
"""Model flags on top of the ``tiny`` Llama preset."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny"], choices=list(MODELS))
    p.add_argument("--runs", nargs="+", default=["fp32", "uniform:fp8", "uniform:fp4"])
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mock-data", action="store_true", help="synthetic tokens (default: corpus)")
    p.add_argument("--micro-batch-size", type=int, default=8, choices=[1, 2, 4, 8],
                   help="sequences per micro-batch (8 a step)")
    return p.parse_args(argv)


def step_times(records: list[dict], skip: int) -> list[float]:
    return [r["step_time_s"] for r in records if "step_time_s" in r and r["step"] > skip]


def main(argv=None) -> None:
    args = parse_args(argv)
    common = ["--train-iters", str(args.train_iters), "--log-interval", "1", "--eval-iters", "0",
              "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", "8",
              *(["--mock-data"] if args.mock_data else [])]
    for model in args.models:
        medians, peaks = {run: [] for run in args.runs}, {run: [] for run in args.runs}
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(args.repeats):
                for run in args.runs:
                    precision, *more = run.split()
                    flags = [*common, *MODELS[model], *precision_flags(precision), *more]
                    records = train(f"{run.replace(' ', '')}-{round_}", flags, Path(tmp))
                    medians[run].append(statistics.median(step_times(records, args.skip)))
                    peaks[run] += [r["mem_gib"] for r in records if "mem_gib" in r]
        base = statistics.median(medians["fp32"]) if "fp32" in medians else None
        print(f"\n{model}: median step time over {args.repeats} rounds "
              f"(steps {args.skip + 1}-{args.train_iters})")
        width = max(20, *map(len, args.runs)) + 1
        print(f"{'run':<{width}}{'ms/step':>9}{'vs fp32':>9}{'peak GiB':>10}   rounds (ms)")
        for run, values in medians.items():
            ms = 1e3 * statistics.median(values)
            ratio = f"{ms / (1e3 * base):8.2f}x" if base else ""
            rounds = " ".join(f"{1e3 * v:.0f}" for v in values)
            peak = f"{max(peaks[run]):10.2f}" if peaks[run] else f"{'':10}"
            print(f"{run:<{width}}{ms:9.0f}{ratio:>9}{peak}   {rounds}", flush=True)


if __name__ == "__main__":
    main()
