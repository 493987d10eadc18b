"""Which model a converted checkpoint holds: :class:`ModelSpec`, saved as a JSON sidecar.

``hf-to-megatron`` writes the spec twice: as ``OUT/megatron_model.json`` for the user (the model
flags ``pretrain_<family>.py`` needs to load the checkpoint), and inside the checkpoint's common
state so ``megatron-to-hf`` / ``verify`` find it without being told. A checkpoint saved later by
training has no spec inside; pass ``--model-config`` with the sidecar, or with the ``args.json``
of the run that trained it (a model trained from scratch then gets a generated config.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from megatron_ext.convert.families import HFFamily, TensorMap
from megatron_ext.convert.gpt2 import GPT2
from megatron_ext.convert.llama import LLAMA
from megatron_ext.training.arguments import parse_args
from megatron_ext.training.checkpointing import CONVERTED_SPEC as SIDECAR
from megatron_ext.errors import UsageError
from megatron_ext.training.presets import ARCH_FIELDS, ModelArch
COMMON_KEY = "hf_conversion"
"""Key of the spec in the checkpoint's dist_checkpointing common state."""
FAMILIES = (LLAMA, GPT2)
"""Supported Hugging Face architectures."""
INTERNAL_FLAGS = ["--transformer-impl", "local", "--distributed-backend", "gloo", "--no-bf16"]
"""How the converter itself builds models: megatron-core's local layers on gloo, in FP32."""


def family_for_config(config: dict) -> HFFamily:
    """The family of a config.json, by ``architectures`` (or ``model_type``)."""
    names = config.get("architectures") or [config.get("model_type")]
    for family in FAMILIES:
        if family.architecture in names or family.model_type in names:
            return family
    supported = ", ".join(f.architecture for f in FAMILIES)
    raise UsageError(f"unsupported architecture {'/'.join(map(str, names))} "
                     f"(supported: {supported})")


def family_named(name: str) -> HFFamily:
    """The family of a megatron_ext family name (``llama`` / ``gpt``)."""
    for family in FAMILIES:
        if family.family == name:
            return family
    raise UsageError(f"unknown model family '{name}'")


def _flag(field: str, value) -> list[str]:
    name = "--" + field.replace("_", "-")
    if isinstance(value, bool):
        return [name if value else "--no-" + name[2:]]
    return [] if value is None else [name, str(value)]


@dataclass(frozen=True)
class ModelSpec:
    """One model as both sides see it; JSON round-trippable."""

    arch: ModelArch
    """megatron_ext architecture: exactly what the model flags of pretrain_<family>.py set."""
    padded_vocab_size: int
    """Embedding / output rows in megatron (``arch.vocab_size`` padded)."""
    make_vocab_size_divisible_by: int
    """The padding multiple (``--make-vocab-size-divisible-by``)."""
    dtype: str
    """Tensor dtype written to the megatron checkpoint, that of the HF weights (``bfloat16``)."""
    hf_config: dict | None
    """The Hugging Face config.json the model came from; None for a model trained from scratch."""

    @property
    def family(self) -> HFFamily:
        return family_named(self.arch.family)

    def flags(self) -> list[str]:
        """Model flags of pretrain_<family>.py that build exactly this model."""
        flags = [f for field in ARCH_FIELDS for f in _flag(field, getattr(self.arch, field))]
        return flags + _flag("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)

    def megatron_args(self, tp: int = 1, pp: int = 1, extra=()) -> argparse.Namespace:
        """Parsed, validated pretrain flags at TP x PP; UsageError if that layout cannot work."""
        from megatron_ext.training.model import padded_vocab_size

        args = parse_args(self.arch.family, [
            *self.flags(), "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), *INTERNAL_FLAGS, *extra], world_size=tp * pp)
        args.padded_vocab_size = padded_vocab_size(self.arch.vocab_size, args)
        return args

    def tensor_maps(self) -> list[TensorMap]:
        return self.family.tensor_maps(self.arch, self.padded_vocab_size)

    def config_json(self) -> dict:
        """config.json for the HF export: the original one, else generated from the flags."""
        return dict(self.hf_config) if self.hf_config else self.family.write_config(self.arch)

    def to_json(self) -> dict:
        return {"family": self.arch.family, "flags": self.flags(),
                "arch": dataclasses.asdict(self.arch), "padded_vocab_size": self.padded_vocab_size,
                "make_vocab_size_divisible_by": self.make_vocab_size_divisible_by,
                "dtype": self.dtype, "hf_config": self.hf_config}

    @classmethod
    def from_json(cls, data: dict) -> ModelSpec:
        return cls(ModelArch(**data["arch"]), data["padded_vocab_size"],
                   data["make_vocab_size_divisible_by"], data["dtype"], data["hf_config"])


def spec_from_hf_config(config: dict, dtype: str, divisible_by: int = 128
                        ) -> tuple[ModelSpec, list[str]]:
    """(spec, warnings) for a Hugging Face config.json; UsageError if it cannot be converted."""
    from megatron_ext.training.model import padded_vocab_size

    arch, warnings = family_for_config(config).read_config(config)
    layout = argparse.Namespace(make_vocab_size_divisible_by=divisible_by,
                                tensor_model_parallel_size=1)
    padded = padded_vocab_size(arch.vocab_size, layout)
    return ModelSpec(arch, padded, divisible_by, dtype, config), warnings


def _check_expressible(arch: ModelArch) -> None:
    """A model trained from scratch must be an exact HF ``architecture`` to be exported as one."""
    family = family_named(arch.family)
    back, _ = family.read_config(family.write_config(arch))
    differ = [f"{f}={getattr(arch, f)}" for f in ARCH_FIELDS
              if f != "seq_length" and getattr(back, f) != getattr(arch, f)]
    if differ:
        raise UsageError(f"this model is not a {family.architecture}: {', '.join(differ)}")


def spec_from_run_args(run_args: dict) -> ModelSpec:
    """The spec of a model trained from scratch, from its run's ``args.json``.

    args.json does not record the tokenizer's vocabulary size, so the export keeps every padded
    row (``vocab_size`` = the padded size)."""
    padded = run_args["padded_vocab_size"]
    # args.json of runs from before a flag existed lacks it: the default is what they ran with
    defaults = {f.name: f.default for f in dataclasses.fields(ModelArch)
                if f.default is not dataclasses.MISSING}
    fields = {**{f: run_args[f] if f in run_args else defaults[f] for f in ARCH_FIELDS},
              "vocab_size": padded}
    arch = ModelArch(family=run_args["family"], **fields)
    _check_expressible(arch)
    dtype = "bfloat16" if run_args.get("bf16") else "float32"
    return ModelSpec(arch, padded, run_args["make_vocab_size_divisible_by"], dtype, None)


def read_spec_file(path: str) -> ModelSpec:
    """``--model-config``: a converter sidecar or a pretrain run's ``args.json``."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model-config: cannot read '{path}': {exc}") from None
    if "arch" in data:
        return ModelSpec.from_json(data)
    if "family" in data and "padded_vocab_size" in data:
        return spec_from_run_args(data)
    raise UsageError(f"--model-config: '{path}' is neither a {SIDECAR} nor a run's args.json")


def find_spec(ckpt_dir: str, model_config: str | None) -> ModelSpec:
    """The spec of checkpoint ``ckpt_dir``: ``--model-config`` if given, else the one
    hf-to-megatron stored inside the checkpoint."""
    from megatron.core import dist_checkpointing

    if model_config:
        return read_spec_file(model_config)
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    if COMMON_KEY not in common:
        raise UsageError(f"--load: '{ckpt_dir}' does not say which model it holds (it was not "
                         f"written by hf-to-megatron); pass --model-config with the converter's "
                         f"{SIDECAR} or the training run's args.json")
    return ModelSpec.from_json(common[COMMON_KEY])
