"""megatron-core checkpoints for the converter: runtime, streaming save, per-layer loads.

**Saving.** ``dist_checkpointing.save`` gets the sharded state dict of a megatron model built on
the ``meta`` device (no memory) at TP = PP = 1. Its ShardedTensors carry the global keys, shapes
and offsets -- per-layer tensors stacked on a prepended axis, the SwiGLU fc1 cut into gate / up
halves by megatron's own factory -- and dist_checkpointing checks that they cover every tensor
exactly once and writes ``common.pt`` / ``metadata.json`` as for any checkpoint. Only writing
the tensor data is ours: :class:`StreamingSaveStrategy` plans the torch.distributed.checkpoint
write from that metadata and asks a ``produce`` callback for each chunk's data when the writer
reaches it. (megatron's default torch_dist strategy resolves every tensor before writing: it
is built to copy GPU tensors to host for an async save, so it needs the whole model in RAM.)

**Loading** is megatron's unchanged torch_dist strategy: ``pretrain_*.py --load`` reads the
checkpoint at any TP / PP layout, and :func:`load_global` reads single layers for the export.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    apply_factories,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from megatron_ext.compat import cpu
from megatron_ext.training import distributed
from megatron_ext.training.checkpointing import (TRACKER, check_model_shapes,
                                                 model_sharded_state)
from megatron_ext.training.checkpoint_integrity import write_manifest
from megatron_ext.errors import UsageError
from megatron_ext.training.model import build_model_chunks, transformer_config

Produce = Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor]
"""(megatron key, global offsets, chunk sizes) -> that chunk of the global tensor."""
ITERATION_DIR = "iter_0000000"
"""A converted checkpoint is iteration 0 of a weights-only save."""


@contextmanager
def megatron_runtime(args):
    """torch.distributed + megatron-core parallel state for ``args``, torn down afterwards (and
    the CPU compatibility layer, if this call switched it on: callers get their process back)."""
    was_patched = cpu.is_active()
    try:
        distributed.initialize(args)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        if not was_patched:
            cpu.deactivate()


def build_model(args, params_dtype: torch.dtype = torch.float32, meta: bool = False,
                device: torch.device | None = None) -> list:
    """This rank's model chunks, uninitialised (weights come from a checkpoint), every
    parameter and buffer on ``device`` (default: this rank's, ``distributed.device()``); with
    ``meta``, built on the ``meta`` device: only the map of keys and shapes."""
    config = transformer_config(args)
    config.params_dtype = params_dtype
    config.perform_initialization = False
    config.use_cpu_initialization = config.use_cpu_initialization or meta
    with torch.device("meta") if meta else nullcontext():
        chunks = build_model_chunks(args, config, args.padded_vocab_size)
    if meta:
        return chunks
    # megatron-core puts its linears on the GPU itself, the torch norms stay on the CPU
    device = device or distributed.device()
    return [chunk.to(device) for chunk in chunks]


def global_shapes(model) -> dict[str, tuple[int, ...]]:
    """megatron key -> global shape (per-layer keys: ``(num_layers, *layer shape)``)."""
    state = model.sharded_state_dict()
    apply_factories(state)
    return {sh.key: tuple(sh.global_shape) for sh in nested_values(state)
            if isinstance(sh, ShardedTensor)}


class _StreamingPlanner(MCoreSavePlanner):
    """megatron's torch_dist save planner, with tensor data produced on demand."""

    def __init__(self, produce: Produce):
        super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False)
        self.produce = produce

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:  # ShardedObjects, already serialised
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk
        data = self.produce(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))
        return data.to(write_item.tensor_data.properties.dtype)


class StreamingSaveStrategy(SaveShardedStrategy):
    """The torch_dist format (what megatron's loader reads), written one chunk at a time.

    ``single_file_per_rank=False`` gives every chunk its own file: torch's writer keeps a
    reference to each tensor until its file is closed, so one file per chunk is what bounds the
    memory to one chunk."""

    def __init__(self, produce: Produce):
        super().__init__("torch_dist", 1)
        self.produce = produce

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        by_key = defaultdict(list)
        for sh in nested_values(sharded_state_dict):
            if is_main_replica(sh.replica_id):
                by_key[sh.unique_key if isinstance(sh, ShardedObject) else sh.key].append(sh)
        writer = dcp.FileSystemWriter(str(checkpoint_dir), single_file_per_rank=False)
        dcp.save(mcore_to_pyt_state_dict(dict(by_key)), storage_writer=writer,
                 planner=_StreamingPlanner(self.produce))


def save_weights(model, produce: Produce, save_dir: str, common: dict) -> str:
    """A weights-only checkpoint (``--load`` takes it as ``--finetune``) of ``model``'s keys
    with data from ``produce``: ``save_dir/iter_0000000`` plus the ``latest`` pointer."""
    path = os.path.join(save_dir, ITERATION_DIR)
    os.makedirs(path)
    state = {"model": model_sharded_state([model]), "weights_only": True,
             "layout": {"tp": 1, "pp": 1, "dp": 1}, **common}
    dist_checkpointing.save(state, path, sharded_strategy=StreamingSaveStrategy(produce))
    write_manifest(path)  # checksums, as every training save writes them
    with open(os.path.join(save_dir, TRACKER), "w", encoding="utf-8") as f:
        f.write("0\n")
    return path


@contextmanager
def _readable(action: str, path: str):
    """A checkpoint dist_checkpointing cannot read becomes one UsageError line."""
    try:
        yield
    except UsageError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"--load: cannot {action} '{path}': {first}") from exc


def checkpoint_metadata(ckpt_dir: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """megatron key -> (global shape, dtype) of every tensor in a checkpoint."""
    with _readable("read the tensor index of", ckpt_dir):
        metadata = dist_checkpointing.load_tensors_metadata(ckpt_dir)
    return {key: (tuple(sh.global_shape), sh.dtype) for key, sh in metadata.items()}


def load_global(ckpt_dir: str, metadata: dict, keys: list[str], layer: int | None) -> dict:
    """The global tensors ``keys`` -- of one ``layer`` for per-layer keys -- whatever layout
    the checkpoint was saved at.

    A layer is requested as a ``[1, ...]`` slice of the stacked ``[layers, ...]`` tensor, not
    through a prepended axis: megatron's prepended-axis path describes the whole grid as owned
    by some rank, which a single process cannot do when it asks for one layer only."""
    request = {}
    for key in keys:
        shape, dtype = metadata[key]
        if layer is None:
            request[key] = ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype))
        else:
            request[key] = ShardedTensor.from_rank_offsets(
                key, torch.empty((1, *shape[1:]), dtype=dtype), (0, layer, shape[0]))
    with _readable("read", ckpt_dir):
        loaded = dist_checkpointing.load(request, ckpt_dir, validate_access_integrity=False)
    return {key: loaded[key] if layer is None else loaded[key][0] for key in keys}


def load_weights(chunks: list, ckpt_dir: str) -> None:
    """Fill this rank's model chunks from a checkpoint (the model part only)."""
    request = {"model": model_sharded_state(chunks)}
    with _readable("read", ckpt_dir):
        check_model_shapes(request["model"], ckpt_dir)  # another model: one line, first
        loaded = dist_checkpointing.load(request, ckpt_dir)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model"][f"chunk{i}"])
