"""``--optimizer stquant-adamw``: flags, validation, the optimizer wrap and the metrics.

Per logged step the metrics gain ``stquant_state_bytes_per_param`` (measured bytes of both
moments — codes, scales and the float32 state of small tensors — over all parameters; FP32
AdamW has 8), ``stquant_avg_bits`` (the width of the quantized layers, weighted by their size:
the paper's "average bit-width") and ``stquant_quantized_fraction``. Rank 0 appends every
width assignment to ``<run-dir>/stquant_widths.jsonl`` (``{"step", "widths": {layer: bits}}``)
for a bit-width evolution plot (paper Fig. 6).
"""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist

from megatron_ext.errors import UsageError, finite_float
from megatron_ext.extension import Extension
from megatron_ext.methods.stquant import dry_run
from megatron_ext.methods.stquant.optimizer import STQuantConfig, STQuantOptimizer
from megatron_ext.methods.stquant.quantizer import BITS
from megatron_ext.methods.stquant.score import ScoreConfig, auto_tau

OPTIMIZERS = ("adam", "stquant-adamw")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("STQuant: optimizer states quantized at a width per layer")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="adam: megatron-core's AdamW (float32 moments); stquant-adamw: the same "
                        "AdamW with m / v stored blockwise at 4/8/16/32 bits per layer, chosen "
                        "by STQuant's score (docs/stquant.md)")
    g.add_argument("--stquant-block-size", type=int, default=64, metavar="B",
                   help="elements per quantization block (one float32 scale each)")
    g.add_argument("--stquant-min-numel", type=int, default=4096, metavar="N",
                   help="parameters with fewer elements (whole tensor, all shards) keep "
                        "float32 state")
    g.add_argument("--stquant-update-every", type=int, default=10, metavar="U",
                   help="rescore the layers every U steps (and at steps 1-4)")
    g.add_argument("--stquant-ema", type=finite_float, default=0.1, metavar="ALPHA",
                   help="EMA factor of the global references N, R, V")
    g.add_argument("--stquant-tau", type=finite_float, default=None, metavar="STEPS",
                   help="time constant of the annealing 1 + sech(t / tau); default "
                        "50 * (layers / 12) * sqrt(256 / global batch)")
    g.add_argument("--stquant-phi", type=finite_float, default=7.2, help="base score (Φ)")
    g.add_argument("--stquant-thresholds", type=finite_float, nargs=3, default=[6.8, 12.0, 24.0],
                   metavar=("T4", "T8", "T16"),
                   help="score boundaries between 4 | 8 | 16 | 32 bits")
    g.add_argument("--stquant-fixed-bits", type=int, choices=BITS, default=None,
                   help="one width for every layer instead of the score (ablations)")
    g.add_argument("--stquant-dry-run-bits", type=int, choices=BITS, default=None,
                   help="--dry-run: the width every layer's m, v is counted at in the "
                        "optimizer memory (default: --stquant-fixed-bits if given, else 8)")


def _flags_given(args: argparse.Namespace) -> list[str]:
    """The ``--stquant-*`` flags whose value is not their default."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    return [f"--{name.replace('_', '-')}" for name, value in defaults.items()
            if name.startswith("stquant_") and getattr(args, name) != value]


def validate(args: argparse.Namespace) -> None:
    if args.optimizer != "stquant-adamw":
        given = _flags_given(args)
        if given:  # they would silently do nothing
            raise UsageError(f"{', '.join(given)} need(s) --optimizer stquant-adamw")
        return
    block = args.stquant_block_size
    if block < 2 or block % 2:
        raise UsageError(f"--stquant-block-size must be an even number >= 2, got {block}")
    if args.stquant_min_numel < 0 or args.stquant_update_every < 1:
        raise UsageError("--stquant-min-numel must be >= 0 and --stquant-update-every >= 1")
    if not 0 < args.stquant_ema <= 1:
        raise UsageError(f"--stquant-ema must be in (0, 1], got {args.stquant_ema}")
    if args.stquant_tau is not None and args.stquant_tau <= 0:
        raise UsageError(f"--stquant-tau must be positive, got {args.stquant_tau}")
    if list(args.stquant_thresholds) != sorted(args.stquant_thresholds):
        raise UsageError("--stquant-thresholds must be increasing")
    if args.use_torch_fsdp2 or args.use_megatron_fsdp:
        raise UsageError("--optimizer stquant-adamw works with megatron's DDP and distributed "
                         "optimizer, not with FSDP")


def config_from_args(args: argparse.Namespace) -> STQuantConfig:
    tau = args.stquant_tau or auto_tau(args.num_layers, args.global_batch_size)
    score = ScoreConfig(tau=tau, phi=args.stquant_phi, thresholds=tuple(args.stquant_thresholds),
                        alpha=args.stquant_ema, update_every=args.stquant_update_every)
    return STQuantConfig(score, args.stquant_block_size, args.stquant_min_numel,
                         args.stquant_fixed_bits)


def _write_widths(args, allocator) -> None:
    record = {"step": allocator.updated_at, "widths": dict(zip(allocator.layers,
                                                               allocator.widths()))}
    with open(os.path.join(args.run_dir, "stquant_widths.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def describe(args: argparse.Namespace) -> str | None:
    """The start-up line of ``--optimizer stquant-adamw``."""
    if args.optimizer != "stquant-adamw":
        return None
    config = config_from_args(args)
    score = config.score
    widths = (f"fixed {config.fixed_bits}-bit" if config.fixed_bits else
              f"{'/'.join(map(str, BITS))} bits per layer by score (tau {score.tau:.3g}, phi {score.phi:g}, "
              f"thresholds {'/'.join(f'{t:g}' for t in score.thresholds)}, re-chosen every "
              f"{score.update_every} steps)")
    return (f"stquant: on | AdamW m, v stored in {config.block}-element blocks, {widths} | "
            f"tensors under {config.min_numel} elements stay FP32")


def stquant_extension(controller=None) -> Extension:
    """The STQuant extension (it shares nothing with the plan controller)."""

    def wrap_optimizer(args, model, optimizer):
        if args.optimizer != "stquant-adamw":
            return optimizer
        return STQuantOptimizer(optimizer, model, config_from_args(args))

    def on_step(args, run, state):
        if args.optimizer != "stquant-adamw":
            return None
        allocator = run.optimizer.allocator
        if allocator.updated_at == allocator.step and dist.get_rank() == 0:
            _write_widths(args, allocator)
        return run.optimizer.metrics()

    return Extension("stquant", add_arguments=add_arguments, validate=validate, describe=describe,
                     wrap_optimizer=wrap_optimizer, on_step=on_step,
                     dry_run_estimate=dry_run.estimate)
