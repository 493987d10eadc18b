"""The probes' Gaussian noise (SNIP steps 2 and 3), the same numbers in every layout.

Each sample of a micro-batch draws from its own CPU generator, seeded by the sample's global
index and the probe's stream, so TP / DP / PP layouts draw exactly what one process draws; a
TP rank that holds a slice of the tensor draws the whole and keeps its slice.

The backward probe's noise is isotropic per token (``--snip-probe isotropic``, the paper's),
or shaped like a dgrad error entering the residual stream (``--snip-probe dgrad``): a real
error ``δdy`` of an entry site (``qkv``, ``fc1``) reaches the stream as ``(δdy·W) ⊙ γ`` through
the site's weight ``W`` and its norm's ``γ``, so its covariance follows ``Wᵀ W`` instead of
the identity; :func:`dgrad_shaped` draws that shape from the last layer's two entry sites.

:class:`ProbeNoise` is the part of a site's observer (:class:`~.stats.SiteObserver`) that
draws the noise during a pass and records its size.
"""

from __future__ import annotations

import torch

from megatron_ext.methods.snip.tensor_store import on_device

PROBES = ("isotropic", "dgrad")
"""``--snip-probe`` choices."""

BASE, PROBE_BACKWARD, PROBE_FORWARD = "base", "probe_backward", "probe_forward"
"""Refresh passes: statistics (step 1), noise in backward (step 2), in forward (step 3)."""


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


class ProbeNoise:
    """Steps 2 and 3 of a site observer: the residual-stream probe (backward) and the noise
    added to the noise site's input (forward). A mixin of :class:`~.stats.SiteObserver`,
    whose attributes it reads: ``mode``, ``sample_offsets``, ``noise_scale``, ``probe_map``,
    ``column``, ``sequence_parallel``, ``tp``, ``tp_rank``, ``dp``, the micro-batch counters
    ``_fwd_micro`` / ``_bwd_micro``, ``stats`` (``noiseF``, ``noiseB``; recorded only while
    ``active``: the noise is added in every group's passes) and ``_tp_complete``."""

    def noise_like(self, t: torch.Tensor, shard_dim: int | None, micro: int) -> torch.Tensor:
        """Per-sample seeded N(0, 1) noise shaped like ``t`` ([s, b, ...]) for micro-batch
        ``micro`` of the pass; when ``shard_dim`` is given ``t`` is this TP rank's slice of
        a dim ``tp`` times larger (every rank draws the full tensor and keeps its slice)."""
        stream = 1 if self.mode == PROBE_BACKWARD else 2
        return seeded_noise(t, shard_dim, self.sample_offsets[micro], stream, self.tp,
                            self.tp_rank)

    def _global_rms(self, t: torch.Tensor, partial: bool) -> float:
        total = t.detach().double().square().sum().reshape(1)
        self._tp_complete(total, partial)
        numel = t.numel() * (self.tp if partial and self.tp > 1 else 1)
        return float(total.sqrt()) / numel ** 0.5

    def add_forward_noise(self, x: torch.Tensor) -> torch.Tensor:
        shard = None if self.column else x.dim() - 1
        sigma = self.noise_scale * self._global_rms(x, shard is not None)
        noise = sigma * self.noise_like(x, shard, self._fwd_micro)
        self._fwd_micro += 1
        rep = 1.0 / self.tp if shard is None else 1.0
        if self.active:
            self.stats["noiseF"] += on_device(noise.square().sum()) * rep
        return x + noise.to(x.dtype)

    def residual_probe(self, grad: torch.Tensor) -> torch.Tensor:
        """Noise ``ξ`` that replaces the gradient of the last layer's output (a tensor hook);
        records ‖ξ‖². Each token's noise is relative to that token's gradient RMS, as a
        block-scaled format's error is; isotropic, or shaped by :attr:`probe_map`. That output
        is this site's: sequence-sharded over TP under SP, else replicated."""
        shard = 0 if self.sequence_parallel else None
        sigma = self.noise_scale * grad.detach().double().square().mean(-1, keepdim=True).sqrt()
        if self.probe_map is None:
            noise = sigma * self.noise_like(grad, shard, self._bwd_micro)
        else:  # dgrad-shaped (single TP rank: flags.py refuses it with TP > 1)
            eps = self.noise_like(grad.new_empty(*grad.shape[:-1], self.probe_map.shape[0]),
                                  shard, self._bwd_micro)
            noise = dgrad_shaped(eps, self.probe_map, sigma)
        self._bwd_micro += 1
        rep = 1.0 / self.tp if shard is None else 1.0
        if self.active:
            self.stats["noiseB"] += on_device(noise.square().sum()) * rep / self.dp ** 2
        return noise.to(grad.dtype)
