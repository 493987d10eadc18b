"""The probes' Gaussian noise (SNIP steps 2 and 3), the same numbers in every layout.

Each sample of a micro-batch draws from its own CPU generator, seeded by the sample's global
index and the probe's stream, so TP / DP / PP layouts draw exactly what one process draws; a
TP rank that holds a slice of the tensor draws the whole and keeps its slice.
"""

from __future__ import annotations

import torch


def seeded_noise(t: torch.Tensor, shard_dim: int | None, first_sample: int, stream: int,
                 tp: int = 1, tp_rank: int = 0) -> torch.Tensor:
    """N(0, 1) float64 noise shaped like ``t`` (``[s, b, ...]``) for the ``b`` samples from
    global index ``first_sample``; with ``shard_dim`` set, ``t`` is TP rank ``tp_rank``'s
    slice of a dim ``tp`` times larger."""
    full = list(t.shape)
    if shard_dim is not None:
        full[shard_dim] *= tp
    per_sample = []
    for b in range(t.shape[1]):
        gen = torch.Generator().manual_seed(4 * (first_sample + b) + stream)
        per_sample.append(torch.randn([full[0], *full[2:]], generator=gen, dtype=torch.float64))
    noise = torch.stack(per_sample, dim=1).to(t.device)  # drawn on the CPU generator
    if shard_dim is not None:
        noise = noise.narrow(shard_dim, tp_rank * t.shape[shard_dim], t.shape[shard_dim])
    return noise
