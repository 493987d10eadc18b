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
  stores what is really there: for every parameter of this rank its moments as **codes +
  scales** (or the float32 tensors of small parameters), its step, its FP32 main copy when
  the model weight is BF16, and the rank's parameter-group settings, as one megatron
  ``ShardedObject`` per rank (key ``optimizer.stquant.tpT.ppP.dpD``; with the
  non-distributed optimizer DP ranks hold replicas and only DP rank 0 writes); the
  allocator's state (step, score engine, widths) goes into the common state. ``load_state_dict``
  puts the same objects back, so a resumed run continues bit for bit. The saved state belongs
  to one TP / PP / DP layout: loading it under another one is refused with one line (load the
  weights alone with ``--finetune``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_ext.errors import UsageError
from megatron_ext.methods.stquant.adamw import QuantizedAdamW, Slot
from megatron_ext.methods.stquant.allocator import Allocator, param_entries
from megatron_ext.methods.stquant.quantizer import QState
from megatron_ext.methods.stquant.score import ScoreConfig, ScoreEngine


@dataclass(frozen=True)
class STQuantConfig:
    """How STQuant quantizes and allocates (flags ``--stquant-*``)."""

    score: ScoreConfig
    """The score engine's constants."""
    block: int = 64
    """Quantization block size ``B`` (elements per scale)."""
    min_numel: int = 4096
    """Parameters with fewer elements (full size, all shards) keep float32 state."""
    fixed_bits: int | None = None
    """One width for every layer instead of the score engine (ablations, tests)."""


def _layout(distributed: bool) -> dict:
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(), "distributed": distributed}


def _stored(value):
    """A moment as saved: a QState's plain dict, or the float32 tensor itself."""
    return value.to_dict() if isinstance(value, QState) else value


def _restored(value):
    return QState.from_dict(value) if isinstance(value, dict) else value


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
                                                     self.allocator.widths, config.block)
        self.distributed = any(e.param.distributed for e in entries)
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

    def _shards(self, data: dict) -> ShardedObject:
        layout = _layout(self.distributed)
        dp = parallel_state.get_data_parallel_rank()
        key = (f"optimizer.stquant.tp{layout['tp']}.pp{layout['pp']}."
               f"dp{layout['dp'] if self.distributed else 1}")
        shape = (layout["pp"], layout["tp"], layout["dp"] if self.distributed else 1)
        offset = (parallel_state.get_pipeline_model_parallel_rank(),
                  parallel_state.get_tensor_model_parallel_rank(), dp if self.distributed else 0)
        return ShardedObject(key, data, shape, offset, replica_id=0 if self.distributed else dp)

    def _local_state(self) -> dict:
        params = {}
        for e in self.allocator.entries:
            main, model = e.param.main, e.param.model
            state = e.param.sub.optimizer.state.get(main)
            if not state:
                continue
            params[e.name] = {"step": state["step"], "exp_avg": _stored(state["exp_avg"]),
                              "exp_avg_sq": _stored(state["exp_avg_sq"]),
                              "main": main if model.dtype != torch.float32 else None}
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in sub.optimizer.param_groups]
                  for sub in self.subs]
        return {"params": params, "param_groups": groups}

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           metadata: dict | None = None) -> dict:
        """This rank's quantized state as a ShardedObject, the allocator in the common state."""
        return {"stquant": {
            "shards": self._shards({} if is_loading else self._local_state()),
            "allocator": self.allocator.state_dict(),
            "layout": _layout(self.distributed)}}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["stquant"]
        if saved["layout"] != _layout(self.distributed):
            raise UsageError(f"--load: the STQuant optimizer state was saved at layout "
                             f"{saved['layout']}, this run is {_layout(self.distributed)}; it "
                             "restores only at the same layout (--finetune loads the weights)")
        self.allocator.load_state_dict(saved["allocator"])
        local = saved["shards"]
        for sub, groups in zip(self.subs, local["param_groups"]):
            for group, stored in zip(sub.optimizer.param_groups, groups):
                group.update(stored)
        for e in self.allocator.entries:
            stored = local["params"].get(e.name)
            if stored is None:
                continue
            e.param.sub.optimizer.state[e.param.main] = {
                "step": stored["step"].clone(), "exp_avg": _restored(stored["exp_avg"]),
                "exp_avg_sq": _restored(stored["exp_avg_sq"])}
            if stored["main"] is not None:
                e.param.main.copy_(stored["main"])
