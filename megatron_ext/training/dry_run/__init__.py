"""``--dry-run``: check a big job's layout and estimate it stage by stage, in one process.

    python pretrain_llama.py --model llama3-70b --tensor-model-parallel-size 4 \\
        --pipeline-model-parallel-size 8 --data-parallel-size 2 --micro-batch-size 1 \\
        --global-batch-size 1024 --seq-length 8192 --dry-run

takes the flags of a real job and, without torchrun, GPUs, data or checkpoints:

1. parses and validates them as the job would, but for the world size the layout asks for,
   ``TP · PP · DP`` (``--data-parallel-size``, default 1), not the launcher's; extensions
   validate their flags too (a bad precision plan fails here as it would in the job);
2. builds every pipeline stage's real megatron-core model on the meta device, in a fake
   one-process world of that size (:mod:`.meta`) — this validates the layout the way
   megatron does and counts each stage's parameters;
3. estimates per stage the memory of one GPU and the pipeline bubble (:mod:`.estimates`,
   formulas and sources there);
4. asks every extension for its part of the report (``Extension.dry_run_estimate``,
   :mod:`.parts`): the precision platform's gives each stage's linear FLOPs, FP4 share and
   time of one micro-batch under the plan the run would start with (the step time and
   tokens/s follow from those); SNIP's solves its ILP for this exact shape with synthetic
   statistics and sizes a refresh. Without an extension that estimates times there is none;
5. prints a table (:mod:`.report`) and, with ``--dry-run-json PATH``, writes it as JSON.

A dry run simulates the GPU job: ``--bf16`` defaults to on (the GPU default) unless given.
Bad input is the usual one-line ``error:`` and exit status 2.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from megatron_ext.errors import UsageError, finite_float
from megatron_ext.io import check_output, write_text_atomic

DEFAULT_GPU_GIB = 80.0
"""Memory of one GPU the stages are compared with (H100 SXM 80 GB)."""
DEFAULT_BF16_TFLOPS = 989.0
"""Dense BF16 tensor-core peak of one GPU (H100 SXM), the rate the times assume."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dry run (check the layout and estimate; starts nothing)")
    g.add_argument("--dry-run", action="store_true",
                   help="build every pipeline stage on the meta device in one process for the "
                        "world TP*PP*DP (--data-parallel-size), print per-stage parameters and "
                        "memory and what each extension estimates (time under the precision "
                        "plan, SNIP's ILP solve), then exit (docs/dry_run.md)")
    g.add_argument("--dry-run-json", default=None, metavar="PATH",
                   help="with --dry-run: also write the report as JSON to PATH")
    g.add_argument("--dry-run-gpu-memory-gib", type=finite_float, default=DEFAULT_GPU_GIB,
                   help="with --dry-run: GPU memory the per-stage estimates are checked against")
    g.add_argument("--dry-run-bf16-tflops", type=finite_float, default=DEFAULT_BF16_TFLOPS,
                   help="with --dry-run: dense BF16 peak of one GPU for the time estimates "
                        "(the other formats' rates: --device-profile)")


def args_provider(inner=None):
    """An ``extra_args_provider`` adding the dry-run flags, then ``inner``'s."""

    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        add_arguments(parser)
        return inner(parser) if inner is not None else parser

    return provide


@dataclass(frozen=True)
class DryRunRequest:
    """What must be known about a dry run before the flags are validated."""

    world_size: int
    """The simulated world, TP · PP · DP."""
    bf16: bool | None
    """``--bf16`` / ``--no-bf16`` as given, or None (then on, the GPU job's default)."""


def request(family: str, argv, provider, optimizers=()) -> DryRunRequest | None:
    """The dry run ``argv`` asks for, or None (read with the entry point's own parser)."""
    from megatron_ext.training.arguments import build_parser

    raw = build_parser(family, provider, optimizers).parse_args(argv)
    if not raw.dry_run:
        if raw.dry_run_json:
            raise UsageError("--dry-run-json needs --dry-run")
        return None
    if raw.dry_run_json:  # before the report, not after it
        if os.path.isdir(raw.dry_run_json):
            raise UsageError(f"--dry-run-json: '{raw.dry_run_json}' is a folder, not a file")
        check_output(os.path.dirname(os.path.abspath(raw.dry_run_json)), "--dry-run-json")
    if raw.dry_run_gpu_memory_gib <= 0 or raw.dry_run_bf16_tflops <= 0:
        raise UsageError("--dry-run-gpu-memory-gib and --dry-run-bf16-tflops must be positive")
    dp = raw.data_parallel_size or 1
    if dp < 1:
        raise UsageError("--data-parallel-size must be positive")
    world = raw.tensor_model_parallel_size * raw.pipeline_model_parallel_size * dp
    return DryRunRequest(world, raw.bf16)


def run(args, req: DryRunRequest, extensions=()):
    """Build, estimate, ask ``extensions``, report (module docstring); returns the
    ``DryRunReport``."""
    from megatron_ext.training.distributed import resolve_launch
    from megatron_ext.training.dry_run.assemble import assemble
    from megatron_ext.training.dry_run.report import format_report

    if req.bf16 is None:
        args.bf16 = True
    report = assemble(args, req, extensions)
    if resolve_launch().rank == 0:
        print(format_report(report), flush=True)
        if args.dry_run_json:
            _write(args.dry_run_json, report.to_json())
    return report


def _write(path: str, text: str) -> None:
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_text_atomic(path, text + "\n")
    except OSError as exc:
        raise UsageError(f"--dry-run-json: cannot write '{path}': {exc.strerror}") from None
