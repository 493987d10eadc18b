"""``megatron-to-hf``: a megatron checkpoint (any TP / PP layout) -> safetensors + config.json.

The checkpoint is read one layer at a time with dist_checkpointing (which assembles each
global tensor from whatever TP / PP shards it was saved as), turned back into the Hugging Face
tensors by the inverse transforms, and written into safetensors shards of at most
``--max-shard-size``. The output's ``config.json`` is the original one (for converted models,
with its dtype updated if training changed it) or one generated from the model flags.
"""

from __future__ import annotations

import os

from megatron_ext.convert.families import TensorMap
from megatron_ext.convert.hf_files import CONFIG, HFShardWriter, write_json
from megatron_ext.convert.megatron_files import (
    build_model,
    checkpoint_metadata,
    global_shapes,
    load_global,
    megatron_runtime,
)
from megatron_ext.convert.outputs import atomic_output_dir, check_new_output
from megatron_ext.convert.spec import find_spec
from megatron_ext.training.checkpointing import resolve_checkpoint_dir
from megatron_ext.errors import UsageError


def check_checkpoint(maps: list[TensorMap], metadata: dict, expected: dict) -> None:
    """The checkpoint holds every tensor the model flags imply, with the implied shape."""
    for tmap in maps:
        if tmap.megatron not in metadata:
            raise UsageError(f"--load: the checkpoint has no tensor '{tmap.megatron}'")
        shape = metadata[tmap.megatron][0]
        if shape != expected[tmap.megatron]:
            raise UsageError(f"--load: checkpoint tensor '{tmap.megatron}' has shape "
                             f"{list(shape)}, the model config says "
                             f"{list(expected[tmap.megatron])} (wrong --model-config?)")


def write_tensors(ckpt_dir: str, metadata: dict, maps: list[TensorMap], num_layers: int,
                  writer: HFShardWriter) -> list[str]:
    """Stream every HF tensor into ``writer``: the non-layer tensors, then layer by layer."""
    once = [m for m in maps if not m.per_layer]
    per_layer = [m for m in maps if m.per_layer]
    for layer, group in [(None, once), *((i, per_layer) for i in range(num_layers))]:
        loaded = load_global(ckpt_dir, metadata, [m.megatron for m in group], layer)
        for tmap in group:
            tensors = tmap.transform.to_hf(loaded[tmap.megatron])
            for name, tensor in zip(tmap.hf_names(layer), tensors):
                writer.add(name, tensor)
    return writer.close()


def _with_dtype(config: dict, dtype: str) -> dict:
    """config.json's dtype entry (``torch_dtype`` in transformers 4, ``dtype`` in 5), if any."""
    return {k: dtype if k in ("dtype", "torch_dtype") else v for k, v in config.items()}


def megatron_to_hf(load: str, out: str, model_config: str | None = None,
                   max_shard_bytes: int = 5 * 10**9, unverified: bool = False) -> list[str]:
    """Export checkpoint ``load`` as a Hugging Face model in ``out``; returns the weight files.
    A checkpoint without checksums only with ``unverified``."""
    check_new_output(out)
    ckpt_dir = resolve_checkpoint_dir(load, unverified)
    spec = find_spec(ckpt_dir, model_config)
    args = spec.megatron_args()
    with megatron_runtime(args):
        maps = spec.tensor_maps()
        metadata = checkpoint_metadata(ckpt_dir)
        check_checkpoint(maps, metadata, global_shapes(build_model(args, meta=True)[0]))
        dtype = str(metadata[maps[0].megatron][1]).removeprefix("torch.")
        with atomic_output_dir(out) as tmp:
            files = write_tensors(ckpt_dir, metadata, maps, spec.arch.num_layers,
                                  HFShardWriter(tmp, max_shard_bytes))
            write_json(os.path.join(tmp, CONFIG), _with_dtype(spec.config_json(), dtype))
    print(f"wrote {spec.family.architecture} ({dtype}) to '{out}': {', '.join(files)}",
          flush=True)
    return files
