"""The baseline promotion rules of ``--gnmr-rule``, against which GNMR's Algorithm 2 is judged.

Every rule runs inside the GNMR extension on the same units, lifts promoted units the same
way (``--gnmr-high``, :mod:`.promote`) and is counted the same way (``gnmr_unit_steps_high``),
so a comparison at equal promoted unit-steps differs only in **which** units run high
**when**. Algorithm 1 (:mod:`.algorithm`) runs under every rule, so the trace carries the
same GNMR columns. A rule's decision after step ``t`` sets the units of step ``t + 1``.

``gnmr`` (default)
    Algorithm 2 (:mod:`.decisions`): thresholds, lock, maxO budget.

``first-last``
    Static: the ``K`` units nearest the ends of the layer stack run high for the whole run,
    from step 1 — the common hand-written recipe "keep the first and last layers in high
    precision" (the platform's ``--keep-first-last-layers-bf16`` does it in BF16; this rule
    uses GNMR's lift, so the format matches the other rules). Units are ranked by their
    layer's distance to the nearer end, the first layer before the last at equal distance,
    then site order: blocks of a 4-layer model go ``L0, L3, L1, L2``.

``static-topk``
    Static after a warm-up, the paper's ADAPT-style baseline (App. E.3: "after a short
    warm-up phase ... averaging GNMR over the warm-up steps, sort blocks by this score, and
    select the top-25 % high-risk blocks ... fixed and no further updates"). The warm-up is
    the first ``round(warmup_frac · T)`` iterations (the stage of the two-stage threshold
    schedule, 2.5 % by default; the paper's 500 steps are ~3 % of its 130M run); after its
    last iteration the ``K`` units with the largest mean GNMR over the warm-up steps
    observed (a skipped step is not) are promoted for the rest of the run (ties: the
    deeper unit). Unlike the paper, the warm-up
    runs in the base plan's precision, not BF16, so it costs no promoted unit-steps.

``static-topk-warm-high``
    ``static-topk`` with App. E.3's warm-up: every unit runs high (``--gnmr-high``) during
    the warm-up stage — the paper's "warm-up phase (500 steps) in BF16" — and those
    unit-steps count in ``gnmr_unit_steps_high``; the same top-K after it.

``autoswitch``
    Transformer Engine's ``AutoswitchGemm`` debug feature re-implemented per unit: a unit
    runs the next step high when, in this step, any low-precision operand of any of its
    sites had an **underflow percentage** (elements non-zero before and zero after
    quantization, per 100 elements) above ``--gnmr-autoswitch-underflow-pct`` or a
    quantization **MSE** (mean of ``(t - q(t))^2`` over the elements, not normalised: TE's
    definition) above ``--gnmr-autoswitch-mse``. Defaults 5.0 and 1e-4 are TE's
    (``underflow_threshold_pct``, ``mse_threshold``). One step, no hold, no budget. The
    statistics come from :mod:`.operand_stats`; non-finite ones count as over.

``K`` is ``--gnmr-topk`` (default: maxO, ``--gnmr-max-promoted``, as a unit count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_ext.methods.gnmr.algorithm import Metrics
from megatron_ext.methods.gnmr.units import unit_layer

RULES = ("gnmr", "first-last", "static-topk", "static-topk-warm-high", "autoswitch")
"""``--gnmr-rule`` choices."""


@dataclass(frozen=True)
class OperandStats:
    """Autoswitch's statistics of one step, one entry per unit (float64 vectors): the
    largest over the unit's low-precision GEMM operands (:mod:`.operand_stats`)."""

    underflow_pct: np.ndarray
    """Percent of an operand's elements that quantization flushed to zero."""
    mse: np.ndarray
    """Mean squared quantization error of an operand (TE's ``mse``)."""
    rel_mse: np.ndarray
    """The same error over the operand's mean square (trace only: scale-free)."""


def end_order(units: Sequence[str], num_layers: int) -> list[int]:
    """Unit indices ordered by how near their layer is to an end of the stack (docstring)."""
    def key(i: int):
        layer = unit_layer(units[i])
        return (min(layer, num_layers - 1 - layer), layer > (num_layers - 1) / 2, i)
    return sorted(range(len(units)), key=key)


def top_k(score: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the ``k`` largest scores, ties to the later (deeper) unit."""
    mask = np.zeros(len(score), dtype=bool)
    order = np.lexsort((-np.arange(len(score)), -score))
    mask[order[:k]] = True
    return mask


class FirstLast:
    """``first-last``: a fixed set from step 1."""

    name = "first-last"

    def __init__(self, units: Sequence[str], k: int, num_layers: int):
        self.high = np.zeros(len(units), dtype=bool)
        self.high[end_order(units, num_layers)[:k]] = True

    def initial(self) -> np.ndarray:
        return self.high.copy()

    def decide(self, iteration: int, metrics: Metrics | None,
               stats: OperandStats | None) -> np.ndarray:
        return self.high.copy()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class StaticTopK:
    """``static-topk``: mean GNMR over the warm-up, then a fixed top-K."""

    def __init__(self, units: Sequence[str], k: int, warmup: int, warm_high: bool = False):
        self.name = "static-topk-warm-high" if warm_high else "static-topk"
        if warmup < 1:
            raise ValueError(f"--gnmr-rule {self.name} chooses after the warm-up stage: "
                             "--gnmr-warmup-frac must give at least one iteration")
        self.k, self.warmup, self.warm_high = k, warmup, warm_high
        self.gnmr_sum = np.zeros(len(units))
        """Sum of each unit's GNMR over the warm-up steps observed."""
        self.observed = 0
        """Warm-up steps observed (a skipped step is not)."""
        self.chosen: np.ndarray | None = None
        """The fixed set (None until the warm-up has ended)."""

    def initial(self) -> np.ndarray:
        return np.full(len(self.gnmr_sum), self.warm_high)

    def decide(self, iteration: int, metrics: Metrics | None,
               stats: OperandStats | None) -> np.ndarray:
        if self.chosen is None:
            if metrics is not None and iteration <= self.warmup:
                self.gnmr_sum = self.gnmr_sum + metrics.gnmr
                self.observed += 1
            if iteration < self.warmup:
                return self.initial()
            self.chosen = top_k(self.gnmr_sum / max(self.observed, 1), self.k)
        return self.chosen.copy()

    def state_dict(self) -> dict:
        return {"gnmr_sum": self.gnmr_sum.tolist(), "observed": self.observed,
                "chosen": None if self.chosen is None else self.chosen.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.gnmr_sum = np.array(state["gnmr_sum"], dtype=np.float64)
        self.observed = int(state["observed"])
        chosen = state["chosen"]
        self.chosen = None if chosen is None else np.array(chosen, dtype=bool)


class Autoswitch:
    """``autoswitch``: per step, per unit, operand statistics over thresholds."""

    name = "autoswitch"

    def __init__(self, units: Sequence[str], underflow_pct: float, mse: float):
        self.units = len(units)
        self.underflow_pct, self.mse = underflow_pct, mse
        self.last: dict = {}
        """Counters of the last decision (units over each threshold)."""

    def initial(self) -> np.ndarray:
        return np.zeros(self.units, dtype=bool)

    def decide(self, iteration: int, metrics: Metrics | None,
               stats: OperandStats | None) -> np.ndarray:
        if stats is None:
            raise ValueError("--gnmr-rule autoswitch decides from operand statistics; "
                             "none were measured this step")
        over_u = ~(stats.underflow_pct <= self.underflow_pct)  # NaN counts as over
        over_m = ~(stats.mse <= self.mse)
        self.last = {"gnmr_autoswitch_underflow": int(over_u.sum()),
                     "gnmr_autoswitch_mse": int(over_m.sum())}
        return over_u | over_m

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def make_rule(name: str, units: Sequence[str], k: int, warmup: int, underflow_pct: float,
              mse: float):
    """The rule object of ``--gnmr-rule name`` (None for ``gnmr``: Algorithm 2 itself)."""
    if name == "gnmr":
        return None
    if name == "first-last":
        return FirstLast(units, k, max(unit_layer(u) for u in units) + 1)
    if name in ("static-topk", "static-topk-warm-high"):
        return StaticTopK(units, k, warmup, warm_high=name == "static-topk-warm-high")
    if name == "autoswitch":
        return Autoswitch(units, underflow_pct, mse)
    raise ValueError(f"--gnmr-rule must be one of {RULES}, got {name!r}")
