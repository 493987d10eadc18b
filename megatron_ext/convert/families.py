"""What one Hugging Face architecture looks like to the converter.

An :class:`HFFamily` says how a ``config.json`` becomes megatron_ext's
:class:`~megatron_ext.training.presets.ModelArch` (the model flags) and back, and lists one
:class:`TensorMap` per megatron global tensor: which HF tensors it is made of, and how.
:mod:`.llama` and :mod:`.gpt2` define the two supported families.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_ext.convert.transforms import IDENTITY, Transform
from megatron_ext.errors import UsageError
from megatron_ext.training.presets import ModelArch

LAYER = "{i}"
"""Placeholder for the layer index in Hugging Face tensor names."""


@dataclass(frozen=True)
class TensorMap:
    """One megatron global tensor and the Hugging Face tensors it is made of."""

    megatron: str
    """megatron-core global key; per-layer keys (``decoder.layers.*``) stack all layers on a
    prepended axis, so one map serves every layer."""
    hf: tuple[str, ...]
    """Hugging Face tensor names, with ``{i}`` for the layer index in per-layer maps."""
    transform: Transform = IDENTITY
    """How the HF tensors become the megatron tensor and back."""

    @property
    def per_layer(self) -> bool:
        return LAYER in self.hf[0]

    def hf_names(self, layer: int | None) -> list[str]:
        """The HF names for ``layer`` (``None`` for maps that are not per layer)."""
        return [name.replace(LAYER, str(layer)) for name in self.hf]


@dataclass(frozen=True)
class HFFamily:
    """How one Hugging Face architecture corresponds to a megatron_ext model family."""

    architecture: str
    """``architectures[0]`` of config.json, e.g. ``LlamaForCausalLM``."""
    model_type: str
    """config.json ``model_type`` (used when ``architectures`` is absent)."""
    family: str
    """megatron_ext family: ``llama`` (pretrain_llama.py) or ``gpt`` (pretrain_gpt.py)."""
    read_config: Callable[[dict], tuple[ModelArch, list[str]]]
    """config.json -> (architecture, warnings); UsageError for what megatron_ext cannot run."""
    write_config: Callable[[ModelArch], dict]
    """Architecture -> config.json, for models that never had one (trained from scratch)."""
    tensor_maps: Callable[[ModelArch, int], list[TensorMap]]
    """(architecture, padded vocabulary size) -> one map per megatron tensor."""
    canonical_name: Callable[[str], str] = lambda name: name
    """HF tensor name as written by ``save_pretrained`` (older files may lack a prefix)."""
    ignored: tuple[str, ...] = ()
    """Regexes of HF tensors that hold no weights (buffers, a tied ``lm_head``)."""


_MISSING = object()


def config_value(config: dict, key: str, default=_MISSING):
    """``config[key]``; UsageError naming the key if it is absent and has no default."""
    value = config.get(key, default)
    if value is _MISSING or (value is None and default is _MISSING):
        raise UsageError(f"config.json has no '{key}'")
    return value


def require(condition: bool, message: str) -> None:
    """UsageError(message) unless ``condition``: one line for a model we cannot convert."""
    if not condition:
        raise UsageError(message)
