"""The ILP's matrices: option tables, dominance pruning, independent blocks, HiGHS arrays.

The math lives in :mod:`megatron_ext.methods.snip.ilp`; this module turns a
:class:`~megatron_ext.methods.snip.problem.Problem` into numpy arrays:

* :class:`Tables` — padded ``sites x options`` arrays of q, FP4 FLOPs, time;
* :func:`dominated` — options no optimum needs;
* :func:`blocks` — the rows of each independent sub-problem. Paper mode splits into one
  block per stage: eq. (5) rows touch disjoint sites and imply eq. (2), so the stages can
  be solved one by one (K small MIPs are far cheaper than one big one). The other modes
  are one block;
* :func:`csc` — a block as HiGHS's column-wise sparse matrix;
* :func:`safe_plan`, :func:`stage_time_bound` — the fallback plan and time mode's ``B``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_ext.methods.snip.problem import Problem


@dataclass(frozen=True)
class Tables:
    """The problem as padded (sites x max options) arrays; padding is never chosen."""

    q: np.ndarray
    """Quality loss, +inf in padding."""
    f: np.ndarray
    """FP4 FLOPs, 0 in padding."""
    t: np.ndarray
    """Option time, +inf in padding."""
    valid: np.ndarray
    """True where a real option sits."""
    stage: np.ndarray
    """Stage of each site."""
    total_flops: float
    """F = Σ_i flops_i."""

    @property
    def e(self) -> np.ndarray:
        """Eq. (2)'s coefficients e_ij = f_ij / F."""
        return self.f / self.total_flops


def tables(problem: Problem) -> Tables:
    """The problem's options as padded arrays."""
    m, n = len(problem.sites), max(len(s.options) for s in problem.sites)
    q, t = np.full((m, n), np.inf), np.full((m, n), np.inf)
    f, valid = np.zeros((m, n)), np.zeros((m, n), dtype=bool)
    for i, site in enumerate(problem.sites):
        k = len(site.options)
        q[i, :k] = [o.q for o in site.options]
        f[i, :k] = [o.fp4_flops for o in site.options]
        t[i, :k] = [o.time for o in site.options]
        valid[i, :k] = True
    return Tables(q, f, t, valid, np.array([s.stage for s in problem.sites]),
                  problem.total_flops)


def dominated(tab: Tables, use_time: bool) -> tuple[np.ndarray, np.ndarray]:
    """(mask of dominated options, index of a kept option dominating each), both m x n.

    ``b`` dominates ``a`` when it is no worse in q, f (and t) and either better in one or
    equal in all with the lower index — a strict order, so every dropped option has a kept
    dominator."""
    q, f = tab.q[:, :, None], tab.f[:, :, None]  # [i, b, a] compares b against a
    qa, fa = tab.q[:, None, :], tab.f[:, None, :]
    no_worse = (q <= qa) & (f >= fa)
    better = (q < qa) | (f > fa)
    if use_time:
        t, ta = tab.t[:, :, None], tab.t[:, None, :]
        no_worse &= t <= ta
        better |= t < ta
    n = q.shape[1]
    lower = np.arange(n)[:, None] < np.arange(n)[None, :]
    dom = no_worse & (better | lower) & tab.valid[:, :, None] & tab.valid[:, None, :]
    mask = dom.any(axis=1)
    dominator = np.argmax(dom & ~mask[:, :, None], axis=1)
    return mask, dominator


@dataclass(frozen=True)
class Row:
    """One constraint row of a block: ``lo <= Σ coef · x <= hi``."""

    coef: np.ndarray
    """Coefficient of each block column."""
    lo: float
    """Lower bound (-inf if none)."""
    hi: float
    """Upper bound (+inf if none)."""
    flops_scale: float | None = None
    """For rows counting FP4 FLOPs: F, so ``coef · F`` are the FLOPs (lets the knapsack
    starting plan work in exact integer units); None otherwise."""


@dataclass(frozen=True)
class Block:
    """An independent sub-problem: some sites, their kept options, the rows over them."""

    site: np.ndarray
    """Site index of each column (non-decreasing)."""
    option: np.ndarray
    """Option index (within the site) of each column."""
    rows: tuple[Row, ...]
    """The rows besides "one option per site"."""

    @property
    def sites(self) -> np.ndarray:
        """The block's site indices, ascending."""
        return np.unique(self.site)


def blocks(problem: Problem, tab: Tables, kept: np.ndarray, budget: float, mode: str,
           bound: float | None) -> list[Block]:
    """The rows of each mode (see :mod:`megatron_ext.methods.snip.ilp`), split into blocks."""
    site, option = np.nonzero(kept)
    e, k = tab.e[site, option], problem.num_stages
    if mode == "paper":
        out = []
        for stage in range(k):
            sel = tab.stage[site] == stage
            out.append(Block(site[sel], option[sel],
                             (Row(e[sel], budget / k, np.inf, tab.total_flops),)))
        return out
    rows = [Row(e, budget, np.inf, tab.total_flops)]
    if mode == "time":
        share = tab.t[site, option] / bound
        for stage in range(k):
            rows.append(Row(np.where(tab.stage[site] == stage, share, 0.0), -np.inf,
                            1.0 - problem.stage_fixed_time[stage] / bound))
    return [Block(site, option, tuple(rows))]


def csc(block: Block):
    """(start, index, value, row_lo, row_hi) for HiGHS: rows are [one per site | rows]."""
    local = np.searchsorted(block.sites, block.site)
    m, ncol = len(block.sites), len(block.site)
    index = np.column_stack([local] + [np.full(ncol, m + r) for r in range(len(block.rows))])
    value = np.column_stack([np.ones(ncol)] + [row.coef for row in block.rows])
    keep = value != 0
    start = np.concatenate([[0], np.cumsum(keep.sum(axis=1))]).astype(np.int32)
    row_lo = np.concatenate([np.ones(m), [row.lo for row in block.rows]])
    row_hi = np.concatenate([np.ones(m), [row.hi for row in block.rows]])
    return start, index[keep].astype(np.int32), value[keep], row_lo, row_hi


def safe_plan(problem: Problem) -> dict[str, str]:
    """Per site the zero-FP4 option of least q (the first on ties): meets no target but
    is always valid."""
    return {s.site: min((o for o in s.options if o.fp4_flops == 0), key=lambda o: o.q).name
            for s in problem.sites}


def fp4_emulated(sites) -> bool:
    """Whether FP4 options are offered but none is faster than its site's fastest option
    without FP4 (``Problem.fp4_emulated``: FP4 runs emulated on the device)."""
    offered = pays = False
    for site in sites:
        t8 = min(o.time for o in site.options if o.fp4_flops == 0)
        fp4 = [o.time for o in site.options if o.fp4_flops > 0]
        offered, pays = offered or bool(fp4), pays or any(t < t8 for t in fp4)
    return offered and not pays


def stage_time_bound(problem: Problem, budget: float) -> float:
    """``B`` of time mode (:mod:`megatron_ext.methods.snip.ilp`), in seconds: the slowest stage
    if each site ran the fraction ``budget`` of its work at its fastest option's speed."""
    stage_time = list(problem.stage_fixed_time)
    for site in problem.sites:
        t8 = min(o.time for o in site.options if o.fp4_flops == 0)
        t4 = min(o.time for o in site.options)
        stage_time[site.stage] += t8 - budget * (t8 - t4)
    return max(stage_time)
