"""STQuant's score engine: per-layer gradient statistics -> a bit width in {4, 8, 16, 32}.

Paper §3.3-3.4, eq. 4-14 and Algorithm 1 lines 5-16. A *layer* is one parameter tensor that
is quantized (its full, unsharded size is at least ``--stquant-min-numel``); smaller ones stay
float32 and take no part. For every layer ``l`` the engine receives three sums over *all* the
layer's gradient elements, whatever the rank layout (the caller reduces them):
``Σ g²``, ``Σ |g|`` and the count ``N``. From them (in float64):

* intensity (eq. 4): ``n_l = sqrt(Σ g² / N)``, the RMS of the gradient;
* variation (eq. 5): ``r_l = σ(|g|) / (μ(|g|) + ε)``, the coefficient of variation of the
  magnitudes, with ``μ = Σ|g| / N`` and ``σ² = Σ g² / N - μ²`` (population variance);
* scale (eq. 11): ``v_l = Σ g² / N``;
* temporal annealing (eq. 10): ``S_t = 1 + sech(t / τ)``, from 2 at ``t = 0`` down to 1;
* global references (eq. 6, 7, 12): exponential moving averages, factor ``α``, of the
  layer means ``mean_l n_l``, ``mean_l r_l``, ``mean_l v_l``;
* score (eq. 13): ``Φ + log2(r_l/R̄) + log2(n_l/N̄) + log2 S_t + log2(v_l/V̄)``;
* Map (eq. 14): ``score < 6.8 -> 4``, ``< 12 -> 8``, ``< 24 -> 16``, else 32 bits.

A layer exactly as sensitive as the average scores ``Φ = 7.2`` (8 bits) once ``S_t ≈ 1``;
one whose ratios multiply to half of that drops to 4 bits, one ~5 octaves above goes to 16.
Statistics are taken, and widths reassigned, when ``t mod U = 0`` or ``t < 5`` (``t`` counts
optimizer steps from 1); between updates the widths stay. Before the first update every
layer has 16 bits (Algorithm 1 line 2).

Choices the paper leaves open, made here (all are flags, see :class:`ScoreConfig`):

* ``α = 0.1``: the references follow roughly the last ten updates.
* EMAs start at 0 (Algorithm 1 line 1) and are **bias-corrected** like Adam's moments
  (divided by ``1 - (1 - α)^k`` after ``k`` updates): without it the first references are
  ``α`` times too small and every layer would score ``3 log2(1/α) ≈ 10`` too high.
* ``ε = 1e-30`` (statistics are float64; squared fp32 gradients are > 1e-90). Every ratio is
  ``(x + ε) / (x̄ + ε)``: a layer whose gradient is all zero gets a hugely negative score
  (4 bits) instead of ``log2(0)``.
* ``U = 10`` steps between updates (a pass over the gradients every 10 steps).
* ``τ``: the paper makes it grow with depth and shrink with batch size (square-root rule)
  but gives no formula; here ``τ = 50 * (L / 12) * sqrt(256 / B)`` steps for ``L``
  transformer layers and a global batch of ``B`` sequences — 50 steps for GPT-2 small at 256
  sequences, 94 for the tiny model at 8 (:func:`auto_tau`).
* Variation: eq. 5 (σ of ``|g|``) rather than Algorithm 1 line 7's ``σ(g) / E|g|``: the text
  defines ``r`` as the CV of the gradient *magnitudes*.
* Intensity is counted twice: ``v_l = n_l²``, so ``log2(v_l / V̄)`` measures what
  ``log2(n_l / N̄)`` does, at twice the slope. We keep eq. 13 as printed, because ``Φ`` and
  the thresholds were calibrated on it; an octave of gradient RMS moves the score by about
  three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

WIDTHS = (4, 8, 16, 32)


@dataclass(frozen=True)
class ScoreConfig:
    """The engine's constants (paper values where the paper gives them)."""

    tau: float
    """Time constant of the annealing ``S_t = 1 + sech(t / τ)``, in optimizer steps."""
    phi: float = 7.2
    """Base bias Φ: the score of an average layer (anchors 8 bits)."""
    thresholds: tuple[float, float, float] = (6.8, 12.0, 24.0)
    """Score boundaries between 4 | 8 | 16 | 32 bits."""
    alpha: float = 0.1
    """EMA factor α of the global references."""
    update_every: int = 10
    """U: statistics and widths are updated at steps ``t`` with ``t mod U = 0``..."""
    warm_steps: int = 5
    """...and at every step ``t`` below this (Algorithm 1: ``t < 5``)."""
    eps: float = 1e-30
    """ε in every ratio and in the variation's denominator."""
    initial_bits: int = 16
    """Width of every layer before the first update."""


def auto_tau(num_layers: int, global_batch: int) -> float:
    """τ growing linearly with depth and with ``1/sqrt(batch)`` (module docstring)."""
    return max(1.0, 50.0 * (num_layers / 12) * math.sqrt(256 / global_batch))


def sech(x: float) -> float:
    """``1 / cosh(x)`` without overflow for large ``x``."""
    e = math.exp(-abs(x))
    return 2 * e / (1 + e * e)


def factors(sums: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(n, r, v)`` per layer from ``sums`` of shape ``(L, 3)``: ``Σg², Σ|g|, N``."""
    sums = sums.double()
    count = sums[:, 2].clamp(min=1)
    v = sums[:, 0] / count
    mu = sums[:, 1] / count
    sigma = (v - mu * mu).clamp(min=0).sqrt()
    return v.sqrt(), sigma / (mu + eps), v


def map_bits(score: float, thresholds: tuple[float, float, float]) -> int:
    """Eq. 14: the width of a score."""
    for width, bound in zip(WIDTHS, thresholds):
        if score < bound:
            return width
    return WIDTHS[-1]


@dataclass
class ScoreEngine:
    """The running state of Algorithm 1 lines 5-16 for ``num_layers`` layers."""

    config: ScoreConfig
    """Constants."""
    num_layers: int
    """Layers taking part (quantized parameter tensors of the whole model)."""
    ema: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    """Raw (not bias-corrected) EMAs of ``mean n``, ``mean r``, ``mean v``."""
    updates: int = 0
    """Updates so far (for the bias correction)."""
    bits: list[int] = field(default_factory=list)
    """Current width of every layer."""
    scores: list[float] = field(default_factory=list)
    """Scores of the last update (empty before the first)."""

    def __post_init__(self):
        if not self.bits:
            self.bits = [self.config.initial_bits] * self.num_layers

    def due(self, step: int) -> bool:
        """Whether step ``t`` (from 1) updates the widths."""
        return step % self.config.update_every == 0 or step < self.config.warm_steps

    def update(self, step: int, sums: torch.Tensor) -> list[int]:
        """Eq. 4-14 for step ``t`` from the reduced ``(L, 3)`` sums; returns the new widths."""
        c = self.config
        n, r, v = factors(sums, c.eps)
        self.updates += 1
        self.ema = [c.alpha * float(x.mean()) + (1 - c.alpha) * e
                    for x, e in zip((n, r, v), self.ema)]
        debias = 1 - (1 - c.alpha) ** self.updates
        ref_n, ref_r, ref_v = (e / debias for e in self.ema)
        temporal = math.log2(1 + sech(step / c.tau))

        def log_ratio(x: torch.Tensor, ref: float) -> torch.Tensor:
            return torch.log2((x + c.eps) / (ref + c.eps))

        score = c.phi + log_ratio(r, ref_r) + log_ratio(n, ref_n) + temporal + log_ratio(v, ref_v)
        self.scores = score.tolist()
        self.bits = [map_bits(s, c.thresholds) for s in self.scores]
        return self.bits

    def state_dict(self) -> dict:
        return {"ema": list(self.ema), "updates": self.updates, "bits": list(self.bits),
                "scores": list(self.scores)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["bits"]) != self.num_layers:
            raise ValueError(f"saved widths of {len(state['bits'])} layers, this model has "
                             f"{self.num_layers}")
        self.ema, self.updates = list(state["ema"]), int(state["updates"])
        self.bits, self.scores = list(state["bits"]), list(state["scores"])
