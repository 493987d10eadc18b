"""Lossless rearrangements between Hugging Face tensors and one megatron global tensor.

Every step is a pure permutation, concatenation or zero padding, so HF -> megatron -> HF gives
back identical bytes. A :class:`Transform` keeps both directions side by side so they cannot
drift apart (the tests check ``to_hf(to_megatron(x)) == x`` for each).

The megatron side is always the *global* (TP = 1) tensor of one layer:

* **Fused QKV.** megatron's ``linear_qkv`` groups rows per query group ``g`` (GQA):
  ``[q heads of g; k head g; v head g]`` for every g -- ``SelfAttention`` views the output as
  ``[groups, (heads/groups + 2) * head_dim]`` and splits it in that order. Hugging Face keeps
  ``q_proj`` / ``k_proj`` / ``v_proj`` apart (Llama) or packs them as ``[q; k; v]`` (GPT-2).
* **SwiGLU fc1.** Globally ``[gate; up]``; dist_checkpointing's swiglu factory cuts each TP
  rank's ``[gate_r; up_r]`` out of it, so nothing here depends on TP.
* **Vocabulary.** megatron pads the embedding / output rows with zeros up to a multiple of
  ``--make-vocab-size-divisible-by``; the way back drops the padding rows.
* **GPT-2 Conv1D** stores weights as ``[in, out]``; torch ``Linear`` (megatron) as ``[out, in]``.

All functions also work on ``meta`` tensors: that is how shapes are validated before any data
is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Transform:
    """A lossless map between some Hugging Face tensors and one megatron tensor."""

    to_megatron: Callable[[list[Tensor]], Tensor]
    """HF tensors (in the order the :class:`~.families.TensorMap` names them) -> megatron's."""
    to_hf: Callable[[Tensor], list[Tensor]]
    """megatron's tensor -> the HF tensors; the exact inverse of ``to_megatron``."""


IDENTITY = Transform(lambda ts: ts[0], lambda t: [t])
"""Same tensor on both sides (norms, most projections, biases)."""

TRANSPOSE = Transform(lambda ts: ts[0].t().contiguous(), lambda t: [t.t().contiguous()])
"""GPT-2 ``Conv1D`` weight ``[in, out]`` <-> torch ``Linear`` weight ``[out, in]``."""


def compose(first: Transform, second: Transform) -> Transform:
    """``first`` then ``second`` towards megatron (``first`` must yield a single tensor)."""
    return Transform(lambda ts: second.to_megatron([first.to_megatron(ts)]),
                     lambda t: first.to_hf(second.to_hf(t)[0]))


def pad_rows(rows: int, padded_rows: int) -> Transform:
    """Vocabulary padding: ``rows`` real rows plus zero rows up to ``padded_rows``."""

    def to_megatron(ts: list[Tensor]) -> Tensor:
        t = ts[0]
        if t.shape[0] != rows:
            raise ValueError(f"{t.shape[0]} rows where vocab_size is {rows}")
        return torch.cat([t, t.new_zeros(padded_rows - rows, *t.shape[1:])])

    return Transform(to_megatron, lambda t: [t[:rows]])


def concat_rows(parts: int) -> Transform:
    """Equal-sized tensors stacked along rows (SwiGLU ``[gate; up]``)."""
    return Transform(lambda ts: torch.cat(ts), lambda t: list(t.chunk(parts)))


def _per_group(t: Tensor, groups: int) -> Tensor:
    return t.reshape(groups, -1, *t.shape[1:])


def qkv(groups: int, head_dim: int) -> Transform:
    """Separate ``q``, ``k``, ``v`` (weights or biases) <-> megatron's per-group fused rows."""

    def to_megatron(ts: list[Tensor]) -> Tensor:
        q, k, v = ts
        fused = torch.cat([_per_group(x, groups) for x in (q, k, v)], dim=1)
        return fused.reshape(-1, *q.shape[1:])

    def to_hf(t: Tensor) -> list[Tensor]:
        q_rows = t.shape[0] // groups - 2 * head_dim
        parts = _per_group(t, groups).split([q_rows, head_dim, head_dim], dim=1)
        return [p.reshape(-1, *t.shape[1:]) for p in parts]

    return Transform(to_megatron, to_hf)


def packed_qkv(groups: int, head_dim: int) -> Transform:
    """One ``[q; k; v]`` tensor (GPT-2 ``c_attn``, rows already ``[out, ...]``) <-> fused rows."""
    inner = qkv(groups, head_dim)
    return Transform(lambda ts: inner.to_megatron(list(ts[0].chunk(3))),
                     lambda t: [torch.cat(inner.to_hf(t))])
