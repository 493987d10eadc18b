"""The distributed engine (STQuant §3.4): one width per layer, the same on every rank.

Every rank lists the parameters it holds optimizer state for (:class:`ParamEntry`). A *layer*
is one model parameter, named by its key in megatron's sharded checkpoint and, for the
weights megatron stacks over transformer layers, the global layer number
(``decoder.layers.mlp.linear_fc1.weight[3]``): the same name on every rank and under every
TP / PP / DP layout. Whether a parameter is quantized is judged on its **full** size — the
local size times TP for tensor-parallel weights, never the distributed optimizer's shard —
so a norm weight or bias (< ``min_numel`` elements) stays float32 under every layout, and a
large weight is quantized even on a rank that holds a sliver of it.

At setup the ranks all-gather their layer names; the sorted union is the layer list, so every
rank indexes the same layers. At a statistics step each rank adds ``Σ g²``, ``Σ |g|`` and the
count of the gradient elements it **owns** into an ``(L, 3)`` float64 tensor, and one
all-reduce over all ranks gives every rank the sums over every element of every layer exactly
once (the sums are layout-independent up to float64 rounding). Ownership follows megatron's
checkpoint replicas: a TP-duplicated parameter (a norm) counts on TP rank 0 only, the tied
output embedding of the last pipeline stage not at all (its first-stage twin counts), and the
same parameter on several data-parallel ranks only on DP rank 0 — unless the distributed
optimizer gives every DP rank its own disjoint slice, which then all count. The score engine
then runs identically on every rank, so every rank assigns the same widths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.utils import unwrap_model

from megatron_ext.errors import UsageError
from megatron_ext.methods.stquant.score import ScoreEngine
from megatron_ext.training.distributed import device, gather_objects
from megatron_ext.training.optimizer import MainParam, main_params


PARTS = ("blocks", "embed")
"""How the per-part metrics split the model: the transformer blocks (and the final norm), and
the embedding / output layer (their share of a small model's parameters dominates its
average; the paper's models are mostly blocks)."""


def part_of(name: str) -> str:
    """The :data:`PARTS` entry of a layer name."""
    return "embed" if name.startswith(("embedding.", "output_layer.")) else "blocks"


@dataclass(frozen=True)
class ParamEntry:
    """One parameter this rank holds optimizer state for."""

    name: str
    """Its layer name (checkpoint key and stacked layer number): the same under every layout."""
    param: MainParam
    """Where it is in megatron's optimizer (model param, main param, shard start)."""
    layer: int | None
    """Index in the layer list, or None: too small, its state stays float32."""
    owner: bool
    """Whether its elements count in global sums (each element of the model exactly once)."""


def _layer_name(sh: ShardedTensor) -> str:
    """The key, plus the global layer number megatron stacks a transformer layer's weights by
    (``decoder.layers.self_attention.linear_qkv.weight[3]``)."""
    stacked = sh.global_offset[:sh.prepend_axis_num]
    return sh.key + "".join(f"[{i}]" for i in stacked)


def _checkpoint_names(model_chunks) -> dict[int, tuple[str, tuple]]:
    """``{id(param): (layer name, replica_id)}`` from the chunks' sharded state dicts."""
    found = {}
    for chunk in unwrap_model(model_chunks):
        for sh in nested_values(chunk.sharded_state_dict()):
            if isinstance(sh, ShardedTensorFactory):  # e.g. SwiGLU's fc1: name its first part
                name = _layer_name(next(iter(nested_values(sh.build()))))
            elif isinstance(sh, ShardedTensor):
                name = _layer_name(sh)
            else:
                continue
            replica = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
            found[id(sh.data)] = (name, replica)
    return found


def _full_numel(model: torch.Tensor) -> int:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return model.numel() * (tp if getattr(model, "tensor_model_parallel", False) else 1)


def param_entries(optimizer, model_chunks, min_numel: int) -> tuple[list[ParamEntry], list[str]]:
    """This rank's entries and the model-wide layer list (collective)."""
    names = _checkpoint_names(model_chunks)
    params = list(main_params(optimizer))
    local = sorted({names[id(mp.model)][0] for mp in params
                    if _full_numel(mp.model) >= min_numel})
    layers = sorted(set().union(*gather_objects(local)))
    index = {name: i for i, name in enumerate(layers)}
    dp_rank = parallel_state.get_data_parallel_rank()
    entries = []
    for mp in params:
        name, replica = names[id(mp.model)]
        replica = (*replica, 0, 0, 0)[:3]
        owner = replica[0] == 0 and replica[1] == 0 and (mp.distributed or dp_rank == 0)
        entries.append(ParamEntry(name, mp, index.get(name), owner))
    return entries, layers


class Allocator:
    """Widths per layer for every rank's :class:`QuantizedAdamW`; its ``advance()`` runs once
    per optimizer step on every rank, after megatron's clipping, before the update."""

    def __init__(self, entries: list[ParamEntry], layers: list[str],
                 engine: ScoreEngine | None, fixed_bits: int | None = None):
        self.entries = entries
        """This rank's parameters (:func:`param_entries`)."""
        self.layers = layers
        """Layer names; ``widths()[i]`` is the width of ``layers[i]``."""
        self.engine = engine
        """The score engine, or None for a fixed width (``fixed_bits``)."""
        self.fixed = [fixed_bits] * len(layers) if engine is None else None
        """The widths without an engine."""
        self.step = 0
        """Optimizer steps taken (``t`` of Algorithm 1)."""
        self.updated_at = 0
        """The last step whose statistics updated the widths."""
        self.part_sums: torch.Tensor | None = None
        """Per part (:data:`PARTS`): parameters, bit-elements, code and scale bytes, summed
        over the :meth:`metrics` calls (their time average's numerator)."""
        self.part_calls = 0
        """:meth:`metrics` calls summed into ``part_sums``."""

    def widths(self) -> list[int]:
        return self.fixed if self.engine is None else self.engine.bits

    def advance(self) -> None:
        """Step ``t += 1``; at a statistics step, reduce the sums and rescore (collective)."""
        self.step += 1
        if self.engine is None or not self.engine.due(self.step):
            return
        sums = torch.zeros(len(self.layers), 3, dtype=torch.float64, device=device())
        for e in self.entries:
            grad = e.param.main.grad
            if e.layer is None or not e.owner or grad is None:
                continue
            sums[e.layer, 0] += torch.linalg.vector_norm(grad, 2, dtype=torch.float64) ** 2
            sums[e.layer, 1] += torch.linalg.vector_norm(grad, 1, dtype=torch.float64)
            sums[e.layer, 2] += grad.numel()
        if dist.is_initialized():
            dist.all_reduce(sums)
        self.engine.update(self.step, sums.cpu())
        self.updated_at = self.step

    def metrics(self) -> dict:
        """Measured state bytes per parameter and the average width, model-wide, and per part
        (:data:`PARTS`) bits, code bytes and scale bytes per parameter, now and averaged over
        the calls so far (collective)."""
        sums = [0] * (4 + 4 * len(PARTS))  # Python ints: exact, and no tensor op per entry
        widths = self.widths()
        for e in self.entries:
            if not e.owner:
                continue
            numel = e.param.main.numel()
            codes, scales = e.param.sub.optimizer.state_nbytes(e.param.main)
            bits = 32 if e.layer is None else widths[e.layer]
            at = 4 + 4 * PARTS.index(part_of(e.name))
            for i, value in ((0, codes + scales), (1, numel), (at, numel), (at + 1, numel * bits),
                             (at + 2, codes), (at + 3, scales)):
                sums[i] += value
            if e.layer is not None:
                sums[2] += numel * bits
                sums[3] += numel
        totals = torch.tensor(sums, dtype=torch.float64)
        if dist.is_initialized():  # NCCL reduces device tensors only
            on_device = totals.to(device())
            dist.all_reduce(on_device)
            totals = on_device.cpu()
        self.part_sums = totals[4:] + (0 if self.part_sums is None else self.part_sums)
        self.part_calls += 1
        nbytes, numel, bit_elems, quantized = totals[:4].tolist()
        out = {"stquant_state_bytes_per_param": nbytes / max(numel, 1),
               "stquant_avg_bits": bit_elems / max(quantized, 1),
               "stquant_quantized_fraction": quantized / max(numel, 1)}
        for i, part in enumerate(PARTS):
            now = totals[4 + 4 * i: 8 + 4 * i].tolist()
            mean = (self.part_sums[4 * i: 4 * i + 4] / self.part_calls).tolist()
            out[f"stquant_params/{part}"] = now[0]
            for suffix, values in (("", now), ("_avg", mean)):
                n = max(values[0], 1)
                out[f"stquant_bits{suffix}/{part}"] = values[1] / n
                out[f"stquant_code_bytes{suffix}/{part}"] = values[2] / n
                out[f"stquant_scale_bytes{suffix}/{part}"] = values[3] / n
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "updated_at": self.updated_at, "layers": list(self.layers),
                "engine": None if self.engine is None else self.engine.state_dict(),
                "part_sums": None if self.part_sums is None else self.part_sums.tolist(),
                "part_calls": self.part_calls}

    def load_state_dict(self, state: dict) -> None:
        if state["layers"] != self.layers:
            raise UsageError("--load: the checkpoint's STQuant layers differ from this run's "
                             "(another model or --stquant-min-numel)")
        self.step, self.updated_at = state["step"], state["updated_at"]
        sums = state.get("part_sums")
        self.part_sums = None if sums is None else torch.tensor(sums, dtype=torch.float64)
        self.part_calls = state.get("part_calls", 0)
        if self.engine is not None and state["engine"] is not None:
            self.engine.load_state_dict(state["engine"])
