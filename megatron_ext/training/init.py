"""Layout-invariant weight initialisation: the same ``--seed`` gives the same model at any TP/PP.

megatron-core draws each rank's weights from that rank's RNG stream, so the initial model
depends on the TP / PP layout. We re-draw every random weight from the *global* tensor it is a
shard of: the model's own ``sharded_state_dict`` (the map dist_checkpointing uses) names each
local tensor's global key, global shape and offset. For every one we seed a generator with
(seed, key, layer index), draw the whole global tensor with megatron's init method, and copy
our slice in. The SwiGLU ``fc1`` weight, stored per TP rank as [gate_r; up_r], is handled by the
same factory dist_checkpointing uses, so checkpoints and init agree on one global layout.

Cost: each rank draws the full tensor of each of its own parameters once (about TP x its own
parameter count); norms and biases keep megatron's constant init.
"""

from __future__ import annotations

import hashlib

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer import TransformerConfig

_OUTPUT_LAYER_SUFFIXES = ("linear_proj.weight", "linear_fc2.weight")


def _stream_seed(seed: int, key: str, layer_offsets: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"{seed}|{key}|{layer_offsets}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sharded_tensors(sharded_state_dict) -> list[ShardedTensor]:
    """Every ShardedTensor of a megatron sharded state dict (factories built)."""
    out = []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensorFactory):
            out.extend(nested_values(value.build()))
        elif isinstance(value, ShardedTensor):
            out.append(value)
    return out


@torch.no_grad()
def _redraw(sh: ShardedTensor, config: TransformerConfig, seed: int) -> None:
    prepend = sh.prepend_axis_num
    generator = torch.Generator().manual_seed(_stream_seed(seed, sh.key, sh.global_offset[:prepend]))
    full = torch.empty(sh.global_shape[prepend:], dtype=torch.float32)
    init = (config.output_layer_init_method if sh.key.endswith(_OUTPUT_LAYER_SUFFIXES)
            else config.init_method)
    init(full, generator=generator)
    index = tuple(slice(o, o + n) for o, n in zip(sh.global_offset[prepend:], sh.data.shape))
    sh.data.copy_(full[index])


def initialize_layout_invariant(model_chunks, config: TransformerConfig, seed: int) -> int:
    """Re-draw every matrix weight of ``model_chunks`` from its global tensor; returns the count."""
    count = 0
    for chunk in model_chunks:
        for sh in sharded_tensors(chunk.sharded_state_dict()):
            if sh.data is None or sh.data.dim() < 2 or not sh.key.endswith("weight"):
                continue  # norms and biases: megatron's constant init is layout-free already
            _redraw(sh, config, seed)
            count += 1
    return count
