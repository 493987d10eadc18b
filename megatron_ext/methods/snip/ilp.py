"""SNIP's precision selection as an integer linear program (SNIP §5.2-5.3), solved by HiGHS.

The model
---------
Site ``i`` (``m`` of them) offers options ``j`` with quality loss ``q_ij``, FP4 FLOPs
``f_ij`` out of the site's ``F_i`` FLOPs, and estimated time ``t_ij``; ``x_ij ∈ {0, 1}``
picks one (:mod:`megatron_ext.methods.snip.problem`). With ``F = Σ_i F_i`` and the efficiency
saving ``e_ij = f_ij / F`` (the share of all linear FLOPs the option runs in FP4):

    (1)  minimise   Σ_ij q_ij x_ij                                     objective
    (2)  subject to Σ_ij e_ij x_ij >= E_t                              efficiency target
    (3)             Σ_j  x_ij = 1                  for every site i    one option per site
    (4)             x_ij ∈ {0, 1}

a multiple-choice ("grouped") knapsack. ``E_t`` (the *budget*) is the FP4 fraction of
linear-layer FLOPs to reach. Pipeline stages ``k = 0..K-1`` add one row each
(``stage_balance``):

* ``"paper"`` — SNIP's eq. (5): Σ_{i∈k} Σ_j e_ij x_ij >= E_t / K. Note that ``e`` is
  normalised by the *whole model's* FLOPs, so this asks every stage for FP4 FLOPs worth
  ``E_t·F/K``; the stage's own FP4 fraction must then be >= ``E_t·F / (K·F_k)``, which is
  ``E_t`` when stages are equal. Eq. (5) implies (2) by summing over ``k``. (The paper's
  ``∀k ∈ 0..K`` is read as the K stages ``0..K-1``, and its ``g`` items per group as the
  sites each stage actually holds.) With uneven stages this asks the small stages for a
  *higher* FP4 fraction than the big (slow) ones — the opposite of balance — and becomes
  infeasible once ``E_t·F/K`` exceeds a small stage's FLOPs (TinyLlama, 22 layers on 4
  stages of 6, 6, 5, 5 layers: for ``E_t > 20/22``).
* ``"time"`` — (2) plus a time cap per stage: Σ_{i∈k} Σ_j t_ij x_ij + c_k <= B, where
  ``c_k`` is the stage's fixed time and ``B`` (``model.stage_time_bound``) is the slowest
  stage's time if every site ran the fraction ``E_t`` of its work at the speed of its
  fastest option and the rest at its all-FP8 speed:

      B = max_k [ c_k + Σ_{i∈k} ( t8_i − E_t · (t8_i − t4_i) ) ],
      t8_i = min{ t_ij : f_ij = 0 },   t4_i = min_j t_ij.

  With FP4 twice FP8 and no fixed time, ``B = (1 − E_t/2) · max_k T8_k``: the *target
  saving* ``1 − B / max_k T8_k`` is ``E_t/2``, what running ``E_t`` of the FLOPs at
  twice the speed saves (less where fixed time dilutes it). Fast stages may take less
  FP4, the slowest must take its share, so uneven stages are balanced on step time.
  The option times come from the run's device profile (:mod:`megatron_ext.precision.
  device_profile`). Where FP4 runs emulated (``Problem.fp4_emulated``: no option with FP4
  FLOPs faster than its site's fastest option without, as on Hopper), FP4 cannot buy time:
  row (2) asks for ``E_t = 0`` (``Solution.fp4_target``) and the plan is the least ``q``
  within ``B``, the slowest stage's time at its fastest zero-FP4 options.
* ``"none"`` — (1)-(4) only.

How it is solved
----------------
1. **Dominance pruning** (:func:`~megatron_ext.methods.snip.ilp_arrays.dominated`): option ``a`` of a
   site is dropped when another option ``b`` of the same site has ``q_b <= q_a``,
   ``f_b >= f_a`` (and ``t_b <= t_a`` in time mode). Every row is monotone in ``f`` and
   ``t``, so swapping ``a`` for ``b`` in a feasible plan keeps it feasible at no higher
   cost: the optimum is unchanged. (Options equal in all three: the first is kept.)
2. **Blocks** (:func:`~megatron_ext.methods.snip.ilp_arrays.blocks`): in paper mode every stage is its
   own MIP (eq. 5 rows touch disjoint sites and imply eq. 2); other modes are one MIP.
3. **Starting plan** per block (:mod:`megatron_ext.methods.snip.incumbent`): the cheaper feasible
   one of the warm start (the previous refresh's plan, ``site -> option name``; a pruned
   option is replaced by the option that dominates it) and a constructed plan (knapsack
   dynamic programming for one-row blocks, Lagrangian greedy otherwise). With a starting
   plan HiGHS runs with its primal heuristics off: they cost more than they find here.
4. Each block goes to HiGHS in one ``passModel`` call (column-wise sparse matrix built
   with numpy: one equality row per site, then the block's rows), the starting plan by
   ``setSolution``; the blocks share the time limit.
5. Outcome: ``optimal`` (every block proven within ``mip_gap``), ``feasible`` (stopped at
   the time limit with a plan meeting every row), or the **safe plan** — per site the
   zero-FP4 option of least ``q`` — with status ``timeout`` (no plan found in time),
   ``infeasible-fallback`` (the rows cannot all be met) or ``error-fallback`` (HiGHS
   failed), and a ``RuntimeWarning``. Bad *input* (budget outside [0, 1], unknown mode)
   raises ``ValueError``; the solve itself never does. The time limit bounds HiGHS; the
   preparation before it (pruning, starting plans) is not interrupted (milliseconds to
   a few tenths of a second at 320 layers).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import numpy as np

from megatron_ext.methods.snip import incumbent
from megatron_ext.methods.snip.highs import BlockResult, run_highs
from megatron_ext.methods.snip.ilp_arrays import (
    Block,
    Tables,
    blocks,
    dominated,
    safe_plan,
    stage_time_bound,
    tables,
)
from megatron_ext.methods.snip.problem import Problem

STAGE_BALANCE = ("paper", "time", "none")
"""Pipeline-stage rows: SNIP eq. (5), the per-stage time cap, or none."""

STATUSES = ("optimal", "feasible", "timeout", "infeasible-fallback", "error-fallback")
"""Solution.status values; the last three carry the safe plan."""


@dataclass(frozen=True)
class SolverConfig:
    """How hard HiGHS may try."""

    time_limit: float = 30.0
    """Seconds for the whole solve before the best plan so far is taken (SNIP §6.1: 30)."""
    mip_gap: float = 1e-6
    """Relative gap (plan vs. proven bound) at which a plan counts as optimal."""
    threads: int = 1
    """HiGHS threads (its MIP search is mostly serial; more rarely helps here)."""
    prune: bool = True
    """Drop dominated options before solving (never changes the optimum)."""
    start: bool = True
    """Construct a starting plan for HiGHS (never changes the optimum, only the time)."""


@dataclass(frozen=True)
class Solution:
    """The chosen plan and how it was found."""

    choice: dict[str, str]
    """Site id -> chosen option name, in problem order."""
    objective: float
    """Σ q of the chosen options (eq. 1)."""
    fp4_fraction: float
    """FP4 share of all linear FLOPs (eq. 2's left side)."""
    stage_fp4_fraction: list[float]
    """Per stage: FP4 share of *that stage's* FLOPs."""
    stage_time: list[float]
    """Per stage: Σ chosen option times + fixed time (seconds)."""
    time_bound: float | None
    """``B`` of time mode (seconds), else None."""
    status: str
    """One of :data:`STATUSES`."""
    mip_gap: float | None
    """Relative gap between the plan and HiGHS's proven bound; None for the safe plan or
    when HiGHS stopped before it had a bound."""
    solve_time: float
    """Wall seconds of :func:`solve` (pruning, starting plan, model build and HiGHS)."""
    budget: float
    """``E_t`` asked for."""
    stage_balance: str
    """Stage rows used (:data:`STAGE_BALANCE`)."""
    pruned: int
    """Options dropped as dominated."""
    message: str = ""
    """Why the plan is not a proven optimum (fallback, or time limit); empty otherwise."""
    fp4_target: float | None = None
    """``E_t`` row (2) asked for: ``budget``, or 0 in time mode where FP4 does not pay."""

    @property
    def fallback(self) -> bool:
        """True when the safe plan was returned instead of a solver plan."""
        return self.status in STATUSES[2:]

    def to_dict(self) -> dict:
        """The plan.json form (see docs/snip.md)."""
        return {"version": 1, "budget": self.budget, "stage_balance": self.stage_balance,
                "status": self.status, "message": self.message, "objective": self.objective,
                "fp4_fraction": self.fp4_fraction,
                "stage_fp4_fraction": self.stage_fp4_fraction, "stage_time": self.stage_time,
                "time_bound": self.time_bound, "mip_gap": self.mip_gap,
                "solve_time": self.solve_time, "pruned": self.pruned,
                "fp4_target": self.fp4_target, "choice": self.choice}


def _check_inputs(problem: Problem, budget: float, mode: str) -> None:
    if (isinstance(budget, bool) or not isinstance(budget, (int, float))
            or not 0.0 <= budget <= 1.0):
        raise ValueError(f"budget must be a fraction in [0, 1], got {budget!r}")
    if mode not in STAGE_BALANCE:
        raise ValueError(f"stage_balance must be one of {STAGE_BALANCE}, got {mode!r}")
    if mode == "time" and stage_time_bound(problem, 0.0) <= 0:
        raise ValueError("stage_balance 'time' needs option times (all are 0)")


def solve(problem: Problem, budget: float, stage_balance: str = "paper",
          config: SolverConfig = SolverConfig(),
          warm_start: dict[str, str] | None = None) -> Solution:
    """The plan minimising Σ q under the budget and stage rows (module docstring)."""
    _check_inputs(problem, budget, stage_balance)
    t0 = time.perf_counter()
    tab = tables(problem)
    mask, dominator = dominated(tab, stage_balance == "time")
    if not config.prune:
        mask = np.zeros_like(mask)
    target = 0.0 if stage_balance == "time" and problem.fp4_emulated else budget
    bound = stage_time_bound(problem, target) if stage_balance == "time" else None
    parts = blocks(problem, tab, tab.valid & ~mask, target, stage_balance, bound)
    warm = _warm_options(problem, warm_start or {}, dominator, mask)
    results = []
    for block in parts:
        left = config.time_limit - (time.perf_counter() - t0)
        results.append(_solve_block(block, tab, warm, config, left))
    status, message = _status(results)
    if status in STATUSES[2:]:
        choice, gap = safe_plan(problem), None
    else:
        option = np.empty(len(problem.sites), dtype=np.int64)
        for block, result in zip(parts, results):
            option[block.sites] = block.option[result.pick]
        choice = {s.site: s.options[j].name for s, j in zip(problem.sites, option)}
        gap = _combined_gap(results)
        if status == "feasible":
            message = (f"time limit ({config.time_limit:g} s) reached before optimality was "
                       f"proven; relative gap {'unknown' if gap is None else f'{gap:.2g}'}")
    if message:
        warnings.warn(f"SNIP ILP: {message}", RuntimeWarning, stacklevel=2)
    return _solution(problem, choice, status, gap, time.perf_counter() - t0, budget,
                     stage_balance, bound, int(mask.sum()), message, target)


def _warm_options(problem: Problem, warm: dict[str, str], dominator: np.ndarray,
                  mask: np.ndarray) -> np.ndarray:
    """Option index per site from ``warm`` (a pruned option -> its dominator); -1 where
    the warm start names no option of the site."""
    out = np.full(len(problem.sites), -1)
    for i, site in enumerate(problem.sites):
        names = [o.name for o in site.options]
        if warm.get(site.site) in names:
            j = names.index(warm[site.site])
            out[i] = dominator[i, j] if mask[i, j] else j
    return out


def _start(block: Block, cost: np.ndarray, warm: np.ndarray, config: SolverConfig):
    """The cheaper feasible one of the warm start and the constructed plan, or None."""
    candidates = []
    wanted = warm[block.sites]
    if (wanted >= 0).all():
        hit = block.option == wanted[np.searchsorted(block.sites, block.site)]
        candidates.append(np.flatnonzero(hit))
    if config.start:
        single = len(block.rows) == 1 and block.rows[0].hi == np.inf
        made = incumbent.knapsack(block, cost) if single else None
        if made is None:
            made = incumbent.greedy(block, cost)
        if made is not None:
            candidates.append(made)
    feasible = [p for p in candidates
                if incumbent.violation(block, incumbent.activity(block, p)) <= incumbent.TOL]
    return min(feasible, key=lambda p: cost[p].sum(), default=None)


def _solve_block(block: Block, tab: Tables, warm: np.ndarray, config: SolverConfig,
                 time_limit: float) -> BlockResult:
    cost = tab.q[block.site, block.option]
    start = _start(block, cost, warm, config)
    if time_limit <= 0:
        return (BlockResult("timeout", detail="time limit spent before this block")
                if start is None else BlockResult("feasible", start, float(cost[start].sum())))
    return run_highs(block, cost, start, time_limit, config.mip_gap, config.threads)


_FALLBACKS = {
    "infeasible": ("infeasible-fallback", "the budget and stage rows cannot all be met"),
    "error": ("error-fallback", "the solver failed"),
    "timeout": ("timeout", "no plan was found within the time limit"),
}
"""Block outcome -> (overall status, why), most serious first."""


def _status(results: list[BlockResult]) -> tuple[str, str]:
    """(overall status, fallback message or "") from the blocks' results."""
    for kind, (status, why) in _FALLBACKS.items():
        failed = [r for r in results if r.status == kind]
        if failed:
            return status, f"{why} ({failed[0].detail}); returning the safe plan (no FP4)"
    return ("optimal" if all(r.status == "optimal" for r in results) else "feasible"), ""


def _combined_gap(results: list[BlockResult]) -> float | None:
    """Relative gap |plan − bound| / |plan| over all blocks; None without a bound."""
    objective = sum(r.objective for r in results)
    bound = sum(r.bound for r in results)
    if not math.isfinite(bound):
        return None
    return abs(objective - bound) / max(abs(objective), 1e-12)


def _solution(problem: Problem, choice: dict[str, str], status: str, gap, seconds: float,
              budget: float, mode: str, bound, pruned: int, message: str,
              target: float | None = None) -> Solution:
    """Evaluate ``choice`` exactly from the problem (not from HiGHS's floats)."""
    k = problem.num_stages
    fp4, flops, stage_time = [0.0] * k, [0.0] * k, list(problem.stage_fixed_time)
    q = []
    for site in problem.sites:
        opt = next(o for o in site.options if o.name == choice[site.site])
        q.append(opt.q)
        fp4[site.stage] += opt.fp4_flops
        flops[site.stage] += opt.flops
        stage_time[site.stage] += opt.time
    return Solution(choice, math.fsum(q), sum(fp4) / sum(flops),
                    [a / b for a, b in zip(fp4, flops)], stage_time, bound, status, gap,
                    seconds, float(budget), mode, pruned, message,
                    float(budget if target is None else target))
