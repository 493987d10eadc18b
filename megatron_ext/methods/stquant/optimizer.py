"""STQuant inside megatron-core: megatron's own optimizer, with quantized AdamW state.

Design. We keep megatron's optimizer — ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``
or ``DistributedOptimizer``, in its ``ChainedOptimizer`` — and everything it does: DP
gradient reduction, the distributed optimizer's reduce-scatter / all-gather and shard
bookkeeping, FP32 main copies of BF16 weights, gradient clipping, the LR scheduler's writes to
the parameter groups. Only its *inner* torch optimizer is replaced: each megatron optimizer's
``.optimizer`` (a ``torch.optim.AdamW`` over its main parameters, or over this rank's shards of
them) becomes a :class:`~.adamw.QuantizedAdamW` over the very same parameter-group dicts. So
each rank quantizes exactly the shard it updates, with blocks placed on the parameter's own
index grid (:mod:`.quantizer`): a block never straddles a shard boundary.

Two things megatron cannot do for quantized state, done here by :class:`STQuantOptimizer`, a
thin wrapper that delegates every other attribute to megatron's optimizer:

* **Widths before the update.** Megatron's ``step()`` prepares (reduces, copies) and clips
  the gradients, then calls ``step_with_ready_grads()``, which runs the inner optimizers. On
  every rank, in between, the allocator (:mod:`.allocator`) must see the final gradients and
  agree on the widths — a collective. The wrapper therefore wraps that one method of the
  megatron optimizer instance: ``allocator.advance()``, then megatron's own
  ``step_with_ready_grads``. Megatron (or ``faults.guarded_step``) skips the whole step on
  every rank alike when gradients are non-finite, so ranks never disagree on ``t``.
* **Checkpoints.** Megatron's optimizer checkpoint formats expect float32 ``exp_avg`` /
  ``exp_avg_sq`` tensors the size of each shard. The wrapper's ``sharded_state_dict`` instead
  stores what is really there — codes + scales per parameter, keyed by the parameter, not the
  rank, so a checkpoint loads at another DP size (:mod:`.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_ext.extension import Conflict, no_fsdp
from megatron_ext.methods.stquant.adamw import QuantizedAdamW, Slot
from megatron_ext.methods.stquant.allocator import Allocator, param_entries
from megatron_ext.methods.stquant.checkpoint import load_request, restore, save_state
from megatron_ext.methods.stquant.score import ScoreConfig, ScoreEngine


@dataclass(frozen=True)
class STQuantConfig:
    """How STQuant quantizes and allocates (flags ``--stquant-*``)."""

    CONFLICTS: ClassVar[tuple[Conflict, ...]] = no_fsdp(
        "it works with megatron's DDP and distributed optimizer, not with FSDP")
    """The flags ``--optimizer stquant-adamw`` does not run with."""
    score: ScoreConfig
    """The score engine's constants."""
    block: int = 64
    """Quantization block size ``B`` (elements per scale)."""
    min_numel: int = 4096
    """Parameters with fewer elements (full size, all shards) keep float32 state."""
    fixed_bits: int | None = None
    """One width for every layer instead of the score engine (ablations, tests)."""
    dry_run_bits: int = 8
    """The width ``--dry-run`` counts every layer's m, v at (``--stquant-dry-run-bits``, else
    ``fixed_bits``, else 8)."""
    cpu_kernel: str = "torch"
    """How CPU parameters step (``--stquant-cpu-kernel``): ``compiled`` (the fused C++
    kernel, :mod:`.cpu_step`), ``torch`` (the torch path) or ``auto`` (compiled when it
    builds, else torch)."""


class STQuantOptimizer:
    """A megatron optimizer whose inner AdamW state is quantized (module docstring)."""

    def __init__(self, optimizer, model_chunks, config: STQuantConfig):
        self.wrapped = optimizer
        """megatron-core's optimizer (every attribute not defined here is read from it)."""
        entries, layers = param_entries(optimizer, model_chunks, config.min_numel)
        engine = None if config.fixed_bits else ScoreEngine(config.score, len(layers))
        self.allocator = Allocator(entries, layers, engine, config.fixed_bits)
        self.subs = [sub for sub in getattr(optimizer, "chained_optimizers", [optimizer])
                     if getattr(sub, "optimizer", None) is not None]
        for sub in self.subs:
            slots = {e.param.main: Slot(e.layer, e.param.start % config.block)
                     for e in entries if e.param.sub is sub}
            sub.optimizer = QuantizedAdamW.replacing(sub.optimizer, slots,
                                                     self.allocator.widths, config.block,
                                                     config.cpu_kernel)
        self.block = config.block
        """Quantization block size (a loaded state is requantized on it)."""
        ready = optimizer.step_with_ready_grads

        def step_with_ready_grads():
            self.allocator.advance()
            return ready()

        optimizer.step_with_ready_grads = step_with_ready_grads

    def __getattr__(self, name):
        return getattr(self.__dict__["wrapped"], name)

    def metrics(self) -> dict:
        """State bytes per parameter and the average width (collective)."""
        return self.allocator.metrics()

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           metadata: dict | None = None) -> dict:
        """Per-parameter codes + scales (:mod:`.checkpoint`); when loading, what to read of
        the checkpoint whose common state the checkpointer passes as
        ``metadata["saved_common"]``. Collective when saving."""
        if is_loading:
            return {"stquant": load_request(self, (metadata or {}).get("saved_common"))}
        return {"stquant": save_state(self)}

    def load_state_dict(self, state_dict: dict) -> None:
        restore(self, state_dict["stquant"])
