"""Algorithm 2 of the GNMR paper: promote risky units to high precision, hold, demote.

After every optimizer step ``t`` (training iteration, 1-based) the controller gets each
unit's gradient norm, runs Algorithm 1 (:mod:`.algorithm`) and decides which units run the
**next** step in high precision (the gradient of step ``t`` was already computed in the
precision chosen after step ``t-1``; the paper's theory: "high-risk at step t, switches to
high precision at t+1")::

    Lock ← max(Lock - 1, 0)
    if   GNMR_t > α_t  or  Δ-GNMR_t > β_t:  P ← high, Lock ← T_lock       (promote / re-arm)
    elif Lock = 0:                          P ← low                       (demote)

A unit promoted at step ``t`` and not triggered again runs high for exactly ``T_lock`` steps,
``t+1 .. t+T_lock`` (``--gnmr-lock 1`` is the paper's analysed case: the next step only).

**Budget (maxO).** At most ``K`` units may be high at once (``--gnmr-max-promoted``: a count,
or a fraction of the units). When more want to be high, the ``K`` with the highest **risk**
stay, where risk is the larger of the two threshold-normalised metrics::

    risk_t = max( v(GNMR_t) / α_t ,  v(Δ-GNMR_t) / β_t )      v(m) = m  (ratio) or m - 1 (excess)

so ``risk > 1`` exactly when a threshold is crossed: a unit triggered this step outranks one
held only by its lock (risk ≤ 1), and among triggered units the one furthest over its
threshold, measured in multiples of it, wins. Ties go to the deeper unit (later in unit order).
A unit the budget turns away runs low and loses its lock. The budget is a hard cap (App. D's
peak-memory bound relies on it), so it can end a lock early.

**Threshold schedule.** Two stages (paper App. E.2): ``α_t = α_init``, ``β_t = β_init`` for
the first ``warmup_frac · T`` iterations (nearest integer, halves up; ``T`` = the run's
iterations), ``α``, ``β`` afterwards.

**Comparison.** ``compare="ratio"`` tests the metric itself against the threshold (the
paper's Algorithm 2); ``compare="excess"`` tests ``metric - 1``, the reading under which the
paper's other numbers (β = 0.3, 0.5, 1.0; fixed α = 0.9, 0.4) describe rare events. The
defaults (ratio; α 3.0 -> 2.0, β 2.0 -> 1.5: the paper's Table 4 pairs, α as a ratio and β as
an excess) reproduce its trigger rates on measured gradient norms (``docs/gnmr.md``).

**Non-finite steps** (:meth:`GnmrController.on_nonfinite`): the loop skipped the update, so
Algorithm 1 does not observe the step and no lock counts down; the units whose norms are
non-finite are promoted (or, if every norm is finite, the one unit whose norm is largest
relative to its running mean), with a full lock and top priority in the budget.

**Baseline rules** (``--gnmr-rule first-last | static-topk | autoswitch``, :mod:`.rules`)
replace Algorithm 2's decision: Algorithm 1 still runs (the trace keeps its columns), the
rule returns the units of the next step, and neither lock nor budget applies. On a skipped
step a static rule keeps its set and ``autoswitch`` decides from that step's statistics.

**Promoted unit-steps.** Every decision adds the units that *ran* high in the step just
decided on (the set the previous decision chose) to ``unit_steps_high``, so after step ``t``
the promoted fraction is ``unit_steps_high / (units · t)`` — the budget the comparison of
rules matches (metrics ``gnmr_unit_steps_high``, ``gnmr_units``). Apart from it, the
cumulative ``gnmr_exceed_alpha`` / ``gnmr_exceed_beta`` count the unit-steps whose metric
crossed its threshold (under every rule): over ``units · t``, the paper's Table-4 rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import numpy as np

from megatron_ext.extension import Conflict, no_fsdp
from megatron_ext.methods.gnmr.algorithm import GnmrState, Metrics
from megatron_ext.methods.gnmr.rules import RULES, OperandStats, make_rule
from megatron_ext.methods.gnmr.units import GRANULARITIES

COMPARES = ("ratio", "excess")
"""``--gnmr-compare`` choices: threshold on the metric, or on the metric minus 1."""

HIGH_CHOICES = ("auto", "fp8", "bf16")
"""``--gnmr-high`` choices (:mod:`.promote`)."""


@dataclass(frozen=True)
class GnmrConfig:
    """GNMR's settings; each field is the flag named in its docstring."""

    CONFLICTS: ClassVar[tuple[Conflict, ...]] = no_fsdp("it reads megatron DDP's gradient "
                                                        "buffers")
    """The flags ``--gnmr`` does not run with."""
    granularity: str = "block"
    """``--gnmr-granularity``: a unit is a transformer block (``block``) or one site."""
    high: str = "auto"
    """``--gnmr-high``: what a promoted site runs in: ``auto`` (FP4 -> FP8, FP8 -> BF16 per
    operand), ``fp8`` or ``bf16`` (:mod:`.promote`)."""
    lock: int = 10
    """``--gnmr-lock``: T_lock, the steps a promoted unit stays high (>= 1)."""
    max_promoted: int | float = 0.25
    """``--gnmr-max-promoted``: maxO, units high at once: an int count (0 = trace only,
    never promote) or a float fraction of the units in (0, 1] (at least one unit)."""
    alpha_init: float = 3.0
    """``--gnmr-alpha-init``: GNMR threshold during the warm-up stage."""
    alpha: float = 2.0
    """``--gnmr-alpha``: GNMR threshold after the warm-up stage (the paper's main runs use
    1.5 -> 1.1; docs/gnmr.md says why the default is stricter)."""
    warmup_frac: float = 0.025
    """``--gnmr-warmup-frac``: fraction of the run's iterations that use the ``*_init``
    thresholds."""
    beta_init: float = 2.0
    """``--gnmr-beta-init``: Δ-GNMR threshold during the warm-up stage."""
    beta: float = 1.5
    """``--gnmr-beta``: Δ-GNMR threshold after the warm-up stage."""
    delta: int = 10
    """``--gnmr-delta``: δ, the window (steps) of Δ-GNMR's short-term mean."""
    compare: str = "ratio"
    """``--gnmr-compare``: ``ratio`` (metric > threshold) or ``excess`` (metric - 1 >
    threshold)."""
    rule: str = "gnmr"
    """``--gnmr-rule``: who decides the promotions: ``gnmr`` (Algorithm 2) or a baseline,
    ``first-last``, ``static-topk``, ``autoswitch`` (:mod:`.rules`)."""
    topk: int | None = None
    """``--gnmr-topk``: K, the units ``first-last`` / ``static-topk`` hold high (None: maxO
    as a count, :meth:`budget`)."""
    autoswitch_underflow_pct: float = 5.0
    """``--gnmr-autoswitch-underflow-pct``: ``autoswitch`` promotes a unit whose operand
    underflow exceeds this percentage (TE AutoswitchGemm's default)."""
    autoswitch_mse: float = 1e-4
    """``--gnmr-autoswitch-mse``: ``autoswitch`` promotes a unit whose operand quantization
    MSE exceeds this (TE AutoswitchGemm's default)."""

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"--gnmr-granularity must be one of {GRANULARITIES}")
        if self.high not in HIGH_CHOICES:
            raise ValueError(f"--gnmr-high must be one of {HIGH_CHOICES}, got {self.high!r}")
        if self.compare not in COMPARES:
            raise ValueError(f"--gnmr-compare must be one of {COMPARES}, got {self.compare!r}")
        for name in ("lock", "delta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--gnmr-{name} must be an integer >= 1, got {value!r}")
        for name in ("alpha_init", "alpha", "beta_init", "beta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"--gnmr-{name.replace('_', '-')} must be a number > 0, "
                                 f"got {value!r}")
        if self.rule not in RULES:
            raise ValueError(f"--gnmr-rule must be one of {RULES}, got {self.rule!r}")
        if self.topk is not None and (isinstance(self.topk, bool)
                                      or not isinstance(self.topk, int) or self.topk < 0):
            raise ValueError(f"--gnmr-topk must be an integer >= 0, got {self.topk!r}")
        for name in ("autoswitch_underflow_pct", "autoswitch_mse"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"--gnmr-{name.replace('_', '-')} must be a number >= 0, "
                                 f"got {value!r}")
        if not 0 <= self.warmup_frac <= 1:
            raise ValueError(f"--gnmr-warmup-frac must be in [0, 1], got {self.warmup_frac}")
        _check_max_promoted(self.max_promoted)

    def budget(self, units: int) -> int:
        """maxO as a number of units for a model with ``units`` units."""
        if isinstance(self.max_promoted, float):
            return max(1, math.floor(self.max_promoted * units + 1e-9))
        return min(self.max_promoted, units)

    def warmup(self, total_steps: int) -> int:
        """Iterations of the warm-up stage of a ``total_steps`` run (nearest, halves up)."""
        return math.floor(self.warmup_frac * total_steps + 0.5)

    def thresholds(self, iteration: int, total_steps: int) -> tuple[float, float]:
        """``(α_t, β_t)`` at training iteration ``iteration`` (1-based) of ``total_steps``."""
        if iteration <= self.warmup(total_steps):
            return float(self.alpha_init), float(self.beta_init)
        return float(self.alpha), float(self.beta)


def _check_max_promoted(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"--gnmr-max-promoted must be a count or a fraction, got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"--gnmr-max-promoted count must be >= 0, got {value}")
    if isinstance(value, float) and not 0 < value <= 1:
        raise ValueError(f"--gnmr-max-promoted fraction must be in (0, 1], got {value}")


def parse_max_promoted(text: str) -> int | float:
    """The ``--gnmr-max-promoted`` value: ``"4"`` -> 4 units, ``"0.25"`` -> a quarter."""
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise ValueError(f"--gnmr-max-promoted must be a count (4) or a fraction (0.25), "
                         f"got {text!r}") from None
    _check_max_promoted(value)
    return value


@dataclass(frozen=True)
class Decision:
    """What one step (or one non-finite step) changed, and its trace line."""

    step: int
    """The training iteration just observed."""
    promoted: tuple[str, ...]
    """Units that run the next step in high precision (unit order)."""
    promotions: tuple[str, ...]
    """Units that were low and are now high."""
    demotions: tuple[str, ...]
    """Units that were high and are now low."""
    trace: dict
    """``{"step": t, "alpha": α_t, "beta": β_t, "units": {unit: {"norm", "agnm", "gnmr",
    "dgnmr", "high", "lock"}}}`` (non-finite numbers as ``None``; ``high`` / ``lock`` after
    the decision); a non-finite step adds ``"nonfinite": true``; a baseline rule adds
    ``"rule"``, and autoswitch per unit ``"underflow_pct"``, ``"mse"``, ``"rel_mse"``."""
    counts: dict = field(default_factory=dict)
    """Per-step counters, merged into the metrics record by :meth:`metrics`."""

    def metrics(self) -> dict:
        """Flat numbers for the step's metrics record."""
        return {"gnmr_units_high": len(self.promoted), "gnmr_promotions": len(self.promotions),
                "gnmr_demotions": len(self.demotions), **self.counts}


def _num(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _stats_entry(stats: OperandStats | None, i: int) -> dict:
    """Unit ``i``'s operand statistics for its trace entry (none without them)."""
    if stats is None:
        return {}
    return {"underflow_pct": _num(stats.underflow_pct[i]), "mse": _num(stats.mse[i]),
            "rel_mse": _num(stats.rel_mse[i])}


@dataclass(eq=False)
class GnmrController:
    """Algorithm 2 over a fixed list of units (build with :meth:`create`); see the module
    docstring. Every rank runs one with the same inputs and so takes the same decisions."""

    config: GnmrConfig
    """The settings."""
    units: tuple[str, ...]
    """Unit ids, in the order of the norm vectors (:func:`.units.unit_ids`)."""
    total_steps: int
    """Iterations of the whole run (the threshold schedule's ``T``)."""
    state: GnmrState
    """Algorithm 1's running state."""
    high: np.ndarray
    """Per unit: runs the next step in high precision (bool)."""
    lock: np.ndarray
    """Per unit: steps left in the lock (int)."""
    risk: np.ndarray
    """Per unit: risk at the last decision (+inf for a non-finite promotion); the budget's
    ranking of units already high when a non-finite step comes."""
    rule: object = None
    """The baseline rule deciding instead of Algorithm 2 (:mod:`.rules`; None: ``gnmr``)."""
    unit_steps_high: int = 0
    """Units that ran high, summed over the steps decided on so far."""
    exceeded: np.ndarray = field(default_factory=lambda: np.zeros(2, dtype=np.int64))
    """Unit-steps whose GNMR crossed α_t and whose Δ-GNMR crossed β_t, summed over the steps
    observed, under every rule: the paper's Table-4 exceedance rate (over units · steps),
    apart from the unit-steps held high (lock, budget, rule)."""

    @classmethod
    def create(cls, config: GnmrConfig, units: Sequence[str], total_steps: int):
        if len(set(units)) != len(units):
            raise ValueError("GNMR unit ids must be distinct")
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be an integer >= 1, got {total_steps!r}")
        n = len(units)
        k = config.budget(n) if config.topk is None else min(config.topk, n)
        rule = make_rule(config.rule, units, k, config.warmup(total_steps),
                         config.autoswitch_underflow_pct, config.autoswitch_mse)
        high = np.zeros(n, dtype=bool) if rule is None else rule.initial()
        return cls(config, tuple(units), total_steps, GnmrState.zeros(n, config.delta),
                   high, np.zeros(n, dtype=np.int64), np.zeros(n), rule)

    @property
    def promoted(self) -> tuple[str, ...]:
        """Units currently high (unit order)."""
        return tuple(u for u, h in zip(self.units, self.high) if h)

    def _v(self, metric: np.ndarray) -> np.ndarray:
        return metric if self.config.compare == "ratio" else metric - 1.0

    def step(self, iteration: int, norms, stats: OperandStats | None = None) -> Decision:
        """Observe step ``iteration``'s unit norms (finite, one per unit) and decide;
        ``stats``: the step's operand statistics (needed by ``--gnmr-rule autoswitch``)."""
        alpha, beta = self.config.thresholds(iteration, self.total_steps)
        m = self.state.update(norms)
        over_alpha = self._v(m.gnmr) > alpha
        over_beta = self._v(m.dgnmr) > beta
        self.exceeded += (int(over_alpha.sum()), int(over_beta.sum()))
        if self.rule is not None:
            header = {"step": iteration, "rule": self.rule.name, "alpha": alpha, "beta": beta}
            return self._rule_decision(header, m, self.rule.decide(iteration, m, stats), stats)
        triggered = over_alpha | over_beta
        risk = np.maximum(self._v(m.gnmr) / alpha, self._v(m.dgnmr) / beta)
        lock = np.where(triggered, self.config.lock, np.maximum(self.lock - 1, 0))
        high = triggered | (lock > 0)  # a lock runs only while high (the budget clears it)
        counts = {"gnmr_over_alpha": int(over_alpha.sum()),
                  "gnmr_over_beta": int(over_beta.sum())}
        header = {"step": iteration, "alpha": alpha, "beta": beta}
        return self._commit(header, high, lock, triggered, risk, m, counts)

    def on_nonfinite(self, iteration: int, norms,
                     stats: OperandStats | None = None) -> Decision:
        """Step ``iteration`` had non-finite gradients and was skipped: promote the units
        whose norms are non-finite or, if all are finite, the one with the largest norm
        relative to its running mean (raw norm before any history). Algorithm 1's state and
        the locks of other units are left as they were. (A baseline rule decides instead,
        module docstring.)"""
        n = np.array(norms, dtype=np.float64)
        if n.shape != (len(self.units),):
            raise ValueError(f"expected {len(self.units)} norms, got shape {n.shape}")
        if self.rule is not None:
            empty = np.full(len(n), np.nan)
            m = Metrics(n, self.state.agnm.copy(), empty, empty)
            header = {"step": iteration, "rule": self.rule.name, "nonfinite": True}
            high = self.rule.decide(iteration, None, stats)
            return self._rule_decision(header, m, high, stats)
        new = ~np.isfinite(n)
        if not new.any():
            new = np.zeros_like(new)
            new[len(n) - 1 - int(np.argmax(self._relative(n)[::-1]))] = True  # ties: deeper
        lock = np.where(new, self.config.lock, self.lock)
        risk = np.where(new, np.inf, self.risk)
        empty = np.full(len(n), np.nan)
        m = Metrics(n, self.state.agnm.copy(), empty, empty)
        header = {"step": iteration, "nonfinite": True}
        return self._commit(header, self.high | new, lock, new, risk, m,
                            {"gnmr_nonfinite_units": int((~np.isfinite(n)).sum())})

    def _rule_decision(self, header, m: Metrics, high, stats) -> Decision:
        """Commit a baseline rule's set: no lock, no budget, the rule's counters."""
        n = len(self.units)
        counts = dict(getattr(self.rule, "last", {}))
        return self._commit(header, high, np.zeros(n, dtype=np.int64), high, np.zeros(n), m,
                            counts, budget=n, stats=stats)

    def _relative(self, n: np.ndarray) -> np.ndarray:
        if self.state.t == 0:
            return n
        agnm = self.state.agnm
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(agnm > 0, n / agnm, np.where(n > 0, np.inf, 0.0))

    def _commit(self, header, high, lock, first, risk, m: Metrics, counts, budget=None,
                stats: OperandStats | None = None) -> Decision:
        """Apply the budget (rank: ``first``, then risk, then depth), store, report."""
        high, lock = high.copy(), lock.copy()
        if budget is None:
            budget = self.config.budget(len(self.units))
        self.unit_steps_high += int(self.high.sum())  # the units that ran this step high
        counts["gnmr_unit_steps_high"] = self.unit_steps_high
        counts["gnmr_units"] = len(self.units)
        counts["gnmr_exceed_alpha"], counts["gnmr_exceed_beta"] = map(int, self.exceeded)
        wanting = np.flatnonzero(high)
        counts["gnmr_budget_dropped"] = max(len(wanting) - budget, 0)
        if len(wanting) > budget:
            order = np.lexsort((-wanting, -risk[wanting], ~first[wanting]))
            dropped = wanting[order[budget:]]
            high[dropped], lock[dropped] = False, 0
        promotions = tuple(u for u, h, o in zip(self.units, high, self.high) if h and not o)
        demotions = tuple(u for u, h, o in zip(self.units, high, self.high) if o and not h)
        self.high, self.lock, self.risk = high, lock.astype(np.int64), risk
        trace = {**header, "units": {
            unit: {"norm": _num(m.norm[i]), "agnm": _num(m.agnm[i]), "gnmr": _num(m.gnmr[i]),
                   "dgnmr": _num(m.dgnmr[i]), "high": bool(high[i]), "lock": int(lock[i]),
                   **_stats_entry(stats, i)}
            for i, unit in enumerate(self.units)}}
        return Decision(header["step"], self.promoted, promotions, demotions, trace, counts)

    def state_dict(self) -> dict:
        """Everything a resume needs, as plain Python data (exact float64 round trip)."""
        return {"version": 1, "units": list(self.units), "algorithm": self.state.state_dict(),
                "high": self.high.tolist(), "lock": self.lock.tolist(),
                "risk": self.risk.tolist(), "rule": self.config.rule,
                "rule_state": self.rule.state_dict() if self.rule else {},
                "unit_steps_high": self.unit_steps_high, "exceeded": self.exceeded.tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (units, δ and the rule must match this run;
        the thresholds, lock length and budget may differ). A state written before the
        rules existed is ``gnmr``'s, with no unit-steps counted."""
        if state.get("version") != 1 or list(state.get("units", ())) != list(self.units):
            raise ValueError("GNMR checkpoint state is for other units (or another version) "
                             "than this run's")
        if state.get("rule", "gnmr") != self.config.rule:
            raise ValueError(f"GNMR checkpoint state is for --gnmr-rule "
                             f"{state.get('rule', 'gnmr')}, this run has {self.config.rule}")
        self.state.load_state_dict(state["algorithm"])
        if self.rule is not None:
            self.rule.load_state_dict(state["rule_state"])
        self.unit_steps_high = int(state.get("unit_steps_high", 0))
        self.exceeded = np.array(state.get("exceeded", (0, 0)), dtype=np.int64)
        self.high = np.array(state["high"], dtype=bool)
        self.lock = np.array(state["lock"], dtype=np.int64)
        self.risk = np.array(state["risk"], dtype=np.float64)
