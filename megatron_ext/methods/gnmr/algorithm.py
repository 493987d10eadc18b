"""Algorithm 1 of the GNMR paper: the gradient-norm ratio and its short-window change, per unit.

A **unit** is what gets promoted as a whole: a transformer block (all its low-precision
sites) or one site (:mod:`.units`). Every step ``t = 1, 2, ...`` gives each unit one number,
the norm of its weight gradient (after the DP reduction, over all TP shards)::

    n_t = ||g_t||

**GNMR** compares it with the mean of all earlier norms (paper eq. 5)::

    AGNM_t  = (1/t) · Σ_{τ≤t} n_τ                   running mean ("average gradient norm")
    GNMR_t  = n_t / AGNM_{t-1}                      GNMR_1 = 1 (no history yet)

and **Δ-GNMR** compares GNMR with the mean of its own last δ values (paper eq. 6)::

    Δ-GNMR_t = GNMR_t / ( (1/δ) · Σ_{τ=1..δ} GNMR_{t-τ} )     for t > δ,   1 for t ≤ δ

GNMR is slow (the whole history is the yardstick, so it says "this step is large for this
unit"); Δ-GNMR is fast (the last δ ratios are the yardstick, so it says "this just jumped").
Both are dimensionless, so one threshold serves every unit.

Neither needs the history itself. The mean updates in place,
``AGNM_t = ((t-1)/t)·AGNM_{t-1} + n_t/t``, and the last δ GNMR values live in a ring buffer
``B[1..δ]`` with a rolling sum ``S``: step ``t`` overwrites slot ``j = (t-1) mod δ`` (the value
from step ``t-δ``) and sets ``S ← S + GNMR_t - old``. So a unit costs ``δ + 2`` floats and
O(1) work per step, whatever ``t`` is. :class:`GnmrState` runs this for all units at once on
float64 numpy vectors.

Ambiguities of the paper, and what this module does
---------------------------------------------------
* **Which t.** Algorithm 1 takes "iteration step t". Here ``t`` counts the observations the
  state has received (:attr:`GnmrState.t` + 1), so eq. 5's ``1/(t-1)`` is exactly the mean of
  the norms seen. A run that switches GNMR on mid-way, or skips a non-finite step (which is
  not observed at all), keeps the mean exact; the training iteration only drives the
  threshold schedule (:mod:`.decisions`).
* **"No history" is AGNM = 0.** Algorithm 1 tests ``AGNM_{t-1} = 0``, not ``t = 1``. Followed
  literally: while a unit's norms are all zero its GNMR is 1 and ``AGNM_t = n_t``, and the
  first non-zero norm restarts the mean (``AGNM_t = n_t``, where eq. 5 would divide by zero).
  For positive norms the two readings agree; the tests check this against eq. 5 directly.
* **Exact arithmetic order.** The rolling sum is updated as ``(S + GNMR_t) - old``, the
  paper's order; the slot of a step ``t ≤ δ`` holds 0, so one formula covers both of its
  branches bit for bit. The rolling sum carries rounding error that grows at most like
  ``t · 2^-53`` relative (1e-10 after a million steps); resume is still exact because the
  sum itself is checkpointed.
* **A zero window.** If a unit's last δ GNMR values are all 0 (its gradient vanished after
  having been non-zero) the mean in eq. 6 is 0: Δ-GNMR is 1 when ``GNMR_t = 0`` too (nothing
  changed) and +inf otherwise (a jump from nothing), instead of 0/0 or x/0.
* **Non-finite or negative norms** are refused (``ValueError``): a non-finite step is
  skipped by the training loop and handled by the controller's ``on_nonfinite``, without
  touching the running state, which would otherwise stay inf/NaN for the rest of the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Metrics:
    """Algorithm 1's outputs at one step, one entry per unit (float64 vectors)."""

    norm: np.ndarray
    """``n_t``, the unit's weight-gradient norm."""
    agnm: np.ndarray
    """``AGNM_t``, the running mean of the norms including this step."""
    gnmr: np.ndarray
    """``GNMR_t = n_t / AGNM_{t-1}`` (1 without history)."""
    dgnmr: np.ndarray
    """``Δ-GNMR_t``, GNMR over the mean of the previous δ GNMR values (1 while t ≤ δ)."""


@dataclass
class GnmrState:
    """The running state of Algorithm 1 for ``U`` units; :meth:`update` advances it a step."""

    delta: int
    """Window length δ of Δ-GNMR (steps)."""
    t: int
    """Steps observed so far (0 = none); the next :meth:`update` is step ``t + 1``."""
    agnm: np.ndarray
    """``AGNM_t`` per unit, shape ``(U,)``."""
    ring: np.ndarray
    """The last δ GNMR values per unit, shape ``(U, δ)``; step ``t`` wrote column
    ``(t-1) mod δ``; columns not yet written hold 0."""
    sgnmr: np.ndarray
    """Rolling sum of each row of :attr:`ring`, shape ``(U,)``."""

    @classmethod
    def zeros(cls, units: int, delta: int) -> "GnmrState":
        """The state before the first step (everything 0, as Algorithm 1 initialises it)."""
        if not isinstance(delta, int) or delta < 1:
            raise ValueError(f"delta (the Δ-GNMR window) must be an integer >= 1, got {delta!r}")
        if not isinstance(units, int) or units < 1:
            raise ValueError(f"need at least one unit, got {units!r}")
        return cls(delta, 0, np.zeros(units), np.zeros((units, delta)), np.zeros(units))

    @property
    def units(self) -> int:
        return self.agnm.shape[0]

    def update(self, norms) -> Metrics:
        """Observe step ``t + 1``'s norms (one per unit) and return its metrics."""
        n = np.array(norms, dtype=np.float64)
        if n.shape != (self.units,):
            raise ValueError(f"expected {self.units} norms, got shape {n.shape}")
        if not np.all(np.isfinite(n)) or np.any(n < 0):
            raise ValueError("norms must be finite and >= 0 (non-finite steps go to "
                             "on_nonfinite and are not observed)")
        t = self.t + 1
        fresh = self.agnm == 0
        with np.errstate(divide="ignore", invalid="ignore"):
            gnmr = np.where(fresh, 1.0, n / self.agnm)
        agnm = np.where(fresh, n, ((t - 1) / t) * self.agnm + n / t)
        dgnmr = self._dgnmr(gnmr, t)
        j = (t - 1) % self.delta
        old = self.ring[:, j].copy()
        self.ring[:, j] = gnmr
        self.sgnmr = (self.sgnmr + gnmr) - old
        self.agnm, self.t = agnm, t
        return Metrics(n, agnm.copy(), gnmr, dgnmr)

    def _dgnmr(self, gnmr: np.ndarray, t: int) -> np.ndarray:
        """Δ-GNMR at step ``t`` from the window before this step (module docstring)."""
        if t <= self.delta:
            return np.ones_like(gnmr)
        mean = self.sgnmr / self.delta
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = gnmr / mean
        return np.where(mean == 0, np.where(gnmr == 0, 1.0, np.inf), ratio)

    def state_dict(self) -> dict:
        """Plain Python data (ints, lists of floats): float64 values round-trip exactly."""
        return {"delta": self.delta, "t": self.t, "agnm": self.agnm.tolist(),
                "ring": self.ring.tolist(), "sgnmr": self.sgnmr.tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; ``ValueError`` if it is for another shape."""
        ring = np.array(state["ring"], dtype=np.float64)
        if state["delta"] != self.delta or ring.shape != self.ring.shape:
            raise ValueError(f"GNMR state is for {ring.shape[0]} units, window "
                             f"{state['delta']}; this run has {self.units} units, window "
                             f"{self.delta}")
        self.t = int(state["t"])
        self.agnm = np.array(state["agnm"], dtype=np.float64)
        self.ring = ring
        self.sgnmr = np.array(state["sgnmr"], dtype=np.float64)
