"""STQuant's flags and the one frozen :class:`~.optimizer.STQuantConfig` built from them in
``validate``. STQuant is on with ``--optimizer stquant-adamw`` (training owns ``--optimizer``;
STQuant brings the choice, ``Extension.optimizers``); its hooks read the config, never the
flags again. Every bad value is a one-line ``UsageError``."""

from __future__ import annotations

import argparse

from megatron_ext.errors import UsageError, finite_float
from megatron_ext.methods.stquant.cpu_step import CHOICES as CPU_KERNELS
from megatron_ext.methods.stquant.optimizer import STQuantConfig
from megatron_ext.methods.stquant.quantizer import BITS
from megatron_ext.methods.stquant.score import ScoreConfig, auto_tau

OPTIMIZER = ("stquant-adamw", "megatron-core's AdamW with m / v stored blockwise at 4/8/16/32 "
             "bits per layer, chosen by STQuant's score (docs/stquant.md)")
"""The ``--optimizer`` choice STQuant brings: (name, help)."""
ENABLED_BY = f"--optimizer {OPTIMIZER[0]}"
"""What switches STQuant on."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(f"STQuant ({ENABLED_BY}): optimizer states quantized at a "
                                  "width per layer")
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
    g.add_argument("--stquant-cpu-kernel", choices=CPU_KERNELS, default="auto",
                   help="how the optimizer step runs on CPU: 'compiled' = one fused C++ pass "
                        "per block (decode m, v, AdamW, encode; built at start-up, cached on "
                        "disk; codes identical to the torch path's, the parameter within an "
                        "ulp), 'torch' = the torch path, 'auto' = compiled when a C++ compiler "
                        "builds it, else torch (one start-up line says which)")


def active(args: argparse.Namespace) -> bool:
    """``--optimizer stquant-adamw``."""
    return args.optimizer == OPTIMIZER[0]


def config_from_args(args: argparse.Namespace) -> STQuantConfig | None:
    """The run's settings, None when STQuant is off; ``UsageError`` for a bad flag."""
    if not active(args):
        return None
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
    tau = args.stquant_tau or auto_tau(args.num_layers, args.global_batch_size)
    score = ScoreConfig(tau=tau, phi=args.stquant_phi, thresholds=tuple(args.stquant_thresholds),
                        alpha=args.stquant_ema, update_every=args.stquant_update_every)
    return STQuantConfig(score, block, args.stquant_min_numel, args.stquant_fixed_bits,
                         args.stquant_dry_run_bits or args.stquant_fixed_bits or 8,
                         args.stquant_cpu_kernel)
