"""``hf-to-megatron``: a Hugging Face checkpoint -> a weights-only megatron checkpoint.

Everything is checked before anything is written:

1. config.json -> family and :class:`~.spec.ModelSpec` (unsupported features stop here);
2. the model flags are parsed as pretrain would parse them at the requested TP x PP (heads,
   query groups, layers and padded vocabulary must divide);
3. every HF tensor's header shape goes through its transform on the ``meta`` device and must
   give megatron's global shape (wrong vocab, missing layers, ...); HF tensors nobody uses are
   refused rather than silently dropped.

Then one process writes the global tensors, streaming (see :mod:`.megatron_files`), into a
temporary directory renamed into place at the end. TP / PP only validate: dist_checkpointing
reshards global tensors to whatever layout ``--load`` runs at.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch

from megatron_ext.convert.families import HFFamily, TensorMap
from megatron_ext.convert.follow_up import follow_up
from megatron_ext.convert.hf_files import CONFIG, HFCheckpoint, read_json, write_json
from megatron_ext.convert.megatron_files import (
    build_model,
    global_shapes,
    megatron_runtime,
    save_weights,
)
from megatron_ext.convert.outputs import atomic_output_dir, check_new_output
from megatron_ext.convert.spec import (
    COMMON_KEY,
    SIDECAR,
    ModelSpec,
    family_for_config,
    spec_from_hf_config,
)
from megatron_ext.errors import UsageError


class HFTensorSource:
    """megatron global tensors computed from HF tensors when the checkpoint writer asks.

    The last computed tensor is kept: the writer asks for the gate and up halves of a layer's
    fc1 one after the other, and both are cut from one ``[gate; up]`` tensor."""

    def __init__(self, ckpt: HFCheckpoint, maps: list[TensorMap]):
        self.ckpt = ckpt
        self.maps = {m.megatron: m for m in maps}
        self._last: tuple = (None, None)

    def global_tensor(self, key: str, layer: int | None) -> torch.Tensor:
        if self._last[0] != (key, layer):
            self._last = (None, None)  # drop the previous tensor before reading the next
            tmap = self.maps[key]
            inputs = [self.ckpt.tensor(name) for name in tmap.hf_names(layer)]
            self._last = ((key, layer), tmap.transform.to_megatron(inputs))
        return self._last[1]

    def __call__(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]):
        skip = 1 if self.maps[key].per_layer else 0  # the prepended layer axis
        full = self.global_tensor(key, offsets[0] if skip else None)
        index = tuple(slice(o, o + n) for o, n in zip(offsets[skip:], sizes[skip:]))
        return full[index].reshape(sizes)


def _check_shape(ckpt: HFCheckpoint, tmap: TensorMap, names: list[str], expected: tuple) -> None:
    try:
        got = tuple(tmap.transform.to_megatron([ckpt.meta(n) for n in names]).shape)
        reason = ""
    except (RuntimeError, ValueError) as exc:
        got, reason = None, f" ({str(exc).splitlines()[0]})"
    if got != expected:
        shapes = ", ".join(f"{n} {list(ckpt.tensors[n].shape)}" for n in names)
        raise UsageError(f"{shapes} does not match config.json: megatron's {tmap.megatron} "
                         f"needs {list(expected)}{reason}")


def check_tensors(ckpt: HFCheckpoint, maps: list[TensorMap], shapes: dict,
                  family: HFFamily) -> None:
    """Every megatron tensor has its HF tensors, of fitting shapes; no HF tensor is left over."""
    unmapped = sorted(set(shapes) - {m.megatron for m in maps})
    if unmapped:
        raise UsageError(f"no Hugging Face source for megatron tensor '{unmapped[0]}'")
    used: set[str] = set()
    for tmap in maps:
        shape = shapes[tmap.megatron]
        for layer in range(shape[0]) if tmap.per_layer else [None]:
            names = tmap.hf_names(layer)
            absent = [n for n in names if n not in ckpt.tensors]
            if absent:
                raise UsageError(f"the Hugging Face checkpoint has no tensor '{absent[0]}'")
            _check_shape(ckpt, tmap, names, shape[1:] if tmap.per_layer else shape)
            used.update(names)
    extra = ckpt.unmatched(used, family.ignored)
    if extra:
        raise UsageError(f"unexpected tensor '{extra[0]}' ({len(extra)} in all) in the Hugging "
                         f"Face checkpoint: config.json does not describe it, or it belongs to a "
                         f"{family.architecture} variant this converter does not support")


def checkpoint_dtype(ckpt: HFCheckpoint) -> tuple[str, list[str]]:
    """The dtype most tensors have (all are written in it), and a warning if they differ."""
    counts = Counter(info.dtype for info in ckpt.tensors.values())
    dtype = counts.most_common(1)[0][0]
    name = str(dtype).removeprefix("torch.")
    mixed = [f"tensors have dtypes {sorted(str(d) for d in counts)}; all are written as {name}"]
    return name, mixed if len(counts) > 1 else []


def hf_to_megatron(hf_dir: str, out: str, tp: int = 1, pp: int = 1,
                   divisible_by: int = 128) -> ModelSpec:
    """Convert ``hf_dir`` into the megatron checkpoint directory ``out``; returns the spec."""
    check_new_output(out)
    config = read_json(os.path.join(hf_dir, CONFIG), "--hf-dir")
    family = family_for_config(config)
    ckpt = HFCheckpoint(hf_dir, family.canonical_name)
    dtype, warnings = checkpoint_dtype(ckpt)
    spec, more_warnings = spec_from_hf_config(config, dtype, divisible_by)
    for warning in warnings + more_warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    spec.megatron_args(tp, pp)  # the layout asked for: validation only
    args = spec.megatron_args()
    with megatron_runtime(args):
        model = build_model(args, getattr(torch, dtype), meta=True)[0]
        maps = spec.tensor_maps()
        check_tensors(ckpt, maps, global_shapes(model), family)
        with atomic_output_dir(out) as tmp:
            save_weights(model, HFTensorSource(ckpt, maps), tmp, {COMMON_KEY: spec.to_json()})
            write_json(os.path.join(tmp, SIDECAR), spec.to_json())
    print(f"converted {spec.family.architecture} '{hf_dir}' -> '{out}' ({spec.dtype})\n"
          + follow_up(spec, hf_dir, out, tp, pp), flush=True)
    return spec
