"""``--optimizer stquant-adamw``: flags, validation, the optimizer wrap and the metrics.

Per logged step the metrics gain ``stquant_state_bytes_per_param`` (measured bytes of both
moments — codes, scales and the float32 state of small tensors — over all parameters; FP32
AdamW has 8), ``stquant_avg_bits`` (the width of the quantized layers, weighted by their size:
the paper's "average bit-width") and ``stquant_quantized_fraction``. Rank 0 appends every
width assignment to ``<run-dir>/stquant_widths.jsonl`` (``{"step", "widths": {layer: bits}}``)
for a bit-width evolution plot (paper Fig. 6).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megatron_ext.extension import Extension
from megatron_ext.methods.stquant import cpu_step, dry_run
from megatron_ext.methods.stquant.flags import (ENABLED_BY, OPTIMIZER, active, add_arguments,
                                                config_from_args)
from megatron_ext.methods.stquant.optimizer import STQuantConfig, STQuantOptimizer
from megatron_ext.methods.stquant.quantizer import BITS
from megatron_ext.methods.stquant.plots import PLOTS


def _write_widths(run_dir: str, allocator) -> None:
    record = {"step": allocator.updated_at, "widths": dict(zip(allocator.layers,
                                                               allocator.widths()))}
    with open(os.path.join(run_dir, "stquant_widths.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


class StquantRun:
    """One run's STQuant: the settings built in ``validate`` (None: off)."""

    def __init__(self):
        self.config: STQuantConfig | None = None
        """The settings (None: STQuant is off)."""
        self.run_dir: str | None = None
        """Where rank 0 appends the widths (``--run-dir``)."""

    def validate(self, args) -> None:
        self.config, self.run_dir = config_from_args(args), args.run_dir

    def wrap_optimizer(self, args, model, optimizer):
        if self.config is None:
            return optimizer
        if self.config.cpu_kernel != "torch" and not torch.cuda.is_available():
            cpu_step.kernel(self.config.cpu_kernel)  # built now: its time or fallback said once
        return STQuantOptimizer(optimizer, model, self.config)

    def on_step(self, args, run, state):
        if self.config is None:
            return None
        allocator = run.optimizer.allocator
        if allocator.updated_at == allocator.step and dist.get_rank() == 0 and self.run_dir:
            _write_widths(self.run_dir, allocator)
        return run.optimizer.metrics() if run.step_result["logged"] else None


def describe(config: STQuantConfig) -> str:
    """The start-up line of ``--optimizer stquant-adamw``."""
    score = config.score
    widths = (f"fixed {config.fixed_bits}-bit" if config.fixed_bits else
              f"{'/'.join(map(str, BITS))} bits per layer by score (tau {score.tau:.3g}, "
              f"phi {score.phi:g}, thresholds {'/'.join(f'{t:g}' for t in score.thresholds)}, "
              f"re-chosen every {score.update_every} steps)")
    return (f"stquant: on | AdamW m, v stored in {config.block}-element blocks, {widths} | "
            f"tensors under {config.min_numel} elements stay FP32")


def stquant_extension(controller=None) -> Extension:
    """The STQuant extension (it shares nothing with the plan controller); it brings the
    ``--optimizer stquant-adamw`` choice."""
    stquant = StquantRun()
    return Extension("stquant", add_arguments=add_arguments, validate=stquant.validate,
                     active=active, enabled_by=ENABLED_BY, optimizers=(OPTIMIZER,), plots=PLOTS,
                     conflicts=STQuantConfig.CONFLICTS,
                     describe=lambda args: describe(stquant.config) if stquant.config else None,
                     wrap_optimizer=stquant.wrap_optimizer, on_step=stquant.on_step,
                     dry_run_estimate=lambda args, context:
                     dry_run.estimate(stquant.config, context))
