"""A weight quantized once per step, not once per micro-batch and GEMM.

A step of ``M`` micro-batches runs every linear's forward ``M`` times on the same weights,
and each real FP8 dgrad reads them again, along N: the optimizer changes them only between
steps. Transformer Engine keeps a layer's FP8 weight and its transpose from the first
micro-batch for the rest of the step (megatron-core tells it through
``is_first_microbatch``); :class:`WeightCache` does the same for the quantized GEMM
(:mod:`.gemm`): fprop's quantized weight is made by the first forward of a step and handed to
the next ``M - 1`` (:meth:`WeightCache.get`), and a real FP8 dgrad's ``q(w)`` along N is made
once and handed to every backward of the step (:meth:`WeightCache.get_for_backward`; per
tensor fprop's cast writes it, :meth:`WeightCache.keep_for_backward`).

What is kept, and what it costs:

* an **emulated** weight only where dgrad reuses fprop's ``q(w)`` (128x128 blocks, one scale
  per tensor, casts): backward keeps that tensor anyway, so the cache adds no peak memory;
  a tile-scaled weight is quantized per micro-batch as before (keeping it would add a
  weight-sized copy);
* a **real FP8** weight (``--fp8-execution``): its FP8 data and scales, one byte per weight
  more while a step's forwards run (TE's trade), and one byte per weight for dgrad's from
  the step's first forward (or dgrad) to its last backward.

**When it is thrown away.** The weights may change between any two steps, and megatron's
optimizer writes them through ``.data`` (no version counter sees it), so the cache trusts no
tensor state: the run's :class:`WeightReuse` counts *generations*, the precision extension
starts a new one before and after every step (so evaluation and the next step never see a
weight of the last), and an entry of another generation is never used. The ``M``-th forward
of a generation lets go of fprop's entry and the ``M``-th backward of dgrad's, so between
steps (the optimizer step included) nothing is held, whatever order a pipeline schedule
runs the forwards and backwards in; forwards beyond ``M`` (activation recomputation,
evaluation) quantize afresh, and a forward without autograd (evaluation) makes no dgrad
entry. Only the layer's own parameter is cached (not a method's transformed weight, which is
new every forward); ``--no-cache-quantized-weights`` turns the cache off. The cached values
are the ones the GEMM would compute: training is bit for bit the same (tested against the
run without the cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class WeightReuse:
    """The run's side of the caches: micro-batches per step and the weights' generation."""

    micro_batches: int
    """Forwards and backwards per step of each linear (megatron's micro-batches on this
    rank)."""
    generation: int = 0
    """Bumped by :meth:`new_weights`; a cache holds entries of one generation only."""

    def new_weights(self) -> None:
        """The weights may have changed (a step ran, or is about to): drop every entry."""
        self.generation += 1


@dataclass
class WeightCache:
    """One linear's quantized weights of the current generation (module docstring)."""

    reuse: WeightReuse
    """The run's generation and micro-batch count."""
    entries: dict = field(default_factory=dict)
    """``(kind, format) -> quantized weight`` for fprop, made in this generation."""
    backward_entries: dict = field(default_factory=dict)
    """``(kind, format) -> quantized weight`` for dgrad (a real FP8 ``q(w)`` along N),
    made in this generation."""
    generation: int = -1
    """The generation the entries belong to."""
    forwards: int = 0
    """Forwards of this linear in that generation."""
    backwards: int = 0
    """Backwards of this linear in that generation."""
    backward_follows: bool = False
    """Whether the current forward records autograd (a backward will read dgrad's entry)."""

    def start_forward(self) -> None:
        """Count a forward of the linear (call once per forward, before :meth:`get`)."""
        self._sync()
        self.forwards += 1
        self.backward_follows = torch.is_grad_enabled()

    def _sync(self) -> None:
        """Drop every entry and count of another generation."""
        if self.generation != self.reuse.generation:
            self.entries, self.backward_entries = {}, {}
            self.generation, self.forwards, self.backwards = self.reuse.generation, 0, 0

    def get(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The entry ``key`` of this generation, made by ``make()`` if there is none; kept
        for later forwards until the step's last (the ``micro_batches``-th) forward."""
        value = self.entries.pop(key, None)
        if value is None:
            value = make()
        if self.forwards < self.reuse.micro_batches:
            self.entries[key] = value
        return value

    def keep_for_backward(self, key: tuple, value: Any) -> None:
        """Keep dgrad's ``value`` (made by a forward) for this generation's backwards."""
        self.backward_entries[key] = value

    def get_for_backward(self, key: tuple, make: Callable[[], Any]) -> Any:
        """dgrad's entry ``key`` of this generation, made by ``make()`` if there is none;
        kept until the generation's ``micro_batches``-th backward (:meth:`end_backward`)."""
        self._sync()
        value = self.backward_entries.get(key)
        if value is None:
            value = self.backward_entries[key] = make()
        return value

    def end_backward(self) -> None:
        """Count a backward of the linear (once per backward, after dgrad): the generation's
        ``micro_batches``-th lets go of dgrad's entries."""
        self._sync()
        self.backwards += 1
        if self.backwards >= self.reuse.micro_batches:
            self.backward_entries.clear()
