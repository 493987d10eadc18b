"""The probes' Gaussian noise (SNIP steps 2 and 3), the same numbers in every layout.

Each sample of a micro-batch draws from its own CPU generator, seeded by the sample's global
index and the probe's stream, so TP / DP / PP layouts draw exactly what one process draws; a
TP rank that holds a slice of the tensor draws the whole and keeps its slice.

The backward probe's noise is isotropic per token (``--snip-probe isotropic``, the paper's),
or shaped like a dgrad error entering the residual stream (``--snip-probe dgrad``): a real
error ``δdy`` of an entry site (``qkv``, ``fc1``) reaches the stream as ``(δdy·W) ⊙ γ`` through
the site's weight ``W`` and its norm's ``γ``, so its covariance follows ``Wᵀ W`` instead of
the identity; :func:`dgrad_shaped` draws that shape from the last layer's two entry sites.
"""

from __future__ import annotations

import torch

PROBES = ("isotropic", "dgrad")
"""``--snip-probe`` choices."""


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


def entry_map(entries: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """``[W_1 ⊙ γ_1; W_2 ⊙ γ_2; ...]`` (float64, ``sum N_i x H``): the map from the entry
    sites' output gradients to the residual stream, each weight's columns scaled by the ``γ``
    of the norm in front of it (None: no affine weight)."""
    rows = []
    for weight, gamma in entries:
        w = weight.detach().double()
        rows.append(w if gamma is None else w * gamma.detach().double())
    return torch.cat(rows, dim=0)


def dgrad_shaped(eps: torch.Tensor, mapping: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``ε · mapping`` for N(0, 1) rows ``ε`` (``[..., sum N_i]``), scaled so that a row's
    expected squared norm is ``H σ²`` (``sigma``: ``[..., 1]``), as the isotropic probe's:
    the same size per token, in the directions a dgrad error takes."""
    rms = float(mapping.square().sum() / mapping.shape[-1]) ** 0.5
    return torch.matmul(eps, mapping) * (sigma / rms)
