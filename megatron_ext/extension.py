"""The seam features plug into: flags, per-layer linear classes, setup and per-step hooks.

A feature (precision plans, SNIP, STQuant, ...) is one :class:`Extension`; an entry point passes
the list it wants to :func:`megatron_ext.training.pretrain.main`. Every hook is optional.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Extension:
    """Callbacks one feature contributes to a training run."""

    name: str
    """Short name, used in messages."""
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    """Adds the feature's flags (an argument group) to the parser."""
    validate: Callable[[argparse.Namespace], None] | None = None
    """Checks the parsed flags; raises ``UsageError`` with a one-line message."""
    linear_classes: Callable[[argparse.Namespace], Callable[[int, str], type]] | None = None
    """Returns ``(global layer, site) -> linear class`` for the layer specs (at most one
    extension of a run may provide it)."""
    after_setup: Callable[..., None] | None = None
    """``after_setup(args, model, checkpointer)``: model built and wrapped, checkpoint state
    may be registered (it runs before ``--load``)."""
    before_step: Callable[..., None] | None = None
    """``before_step(args, run, state)`` before each optimizer step (``run`` is the
    ``TrainingRun``: model, optimizer, datasets): extra passes, plan switches."""
    on_step: Callable[..., dict | None] | None = None
    """``on_step(args, model, state)`` after each optimizer step; a returned dict is merged
    into that step's metrics record."""
    on_nonfinite: Callable[..., dict | None] | None = None
    """``on_nonfinite(args, model, state)`` on every rank after a step whose loss or
    gradients were not finite (its update was skipped, ``state.iteration`` is that step), before
    the next one: the place to fall offending sites back to high precision. A returned dict is
    merged into that step's metrics record (docs/faults.md)."""


def args_provider(extensions: list[Extension]):
    """Megatron-LM style ``extra_args_provider`` adding every extension's flags."""

    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for ext in extensions:
            if ext.add_arguments is not None:
                ext.add_arguments(parser)
        return parser

    return provide


def linear_classes(extensions: list[Extension], args: argparse.Namespace):
    """The one extension-provided linear-class map, or None for megatron's defaults."""
    providers = [ext for ext in extensions if ext.linear_classes is not None]
    if len(providers) > 1:
        names = ", ".join(ext.name for ext in providers)
        raise ValueError(f"several extensions provide linear classes: {names}")
    return providers[0].linear_classes(args) if providers else None
