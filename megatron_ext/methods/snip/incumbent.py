"""Starting plans for the ILP: a good feasible plan up front lets HiGHS cut the search by
bound at once, so most of its work is proving optimality rather than finding a plan.

A plan of a :class:`~megatron_ext.methods.snip.ilp_arrays.Block` is ``pick``: one block column per block
site (sites in ascending order). Two constructions; either way HiGHS proves (or improves)
the result:

* :func:`knapsack` — a block with one row (paper mode's stages, ``none`` mode) is a
  multiple-choice knapsack; when its FP4 FLOPs are whole numbers, dynamic programming in
  units of their greatest common divisor finds the optimum exactly. Real shapes need few
  units: a 70B layer's four sites are 5 + 4 + 28 + 14 = 51 units of ``2·T·8192·2048``
  FLOPs per GEMM;
* :func:`greedy` — any rows: the Lagrangian choice for the FLOP row (each site takes the
  option minimising ``q − λ·e``, the smallest λ meeting the row found by bisection),
  greedy repair of the other rows (best violation drop per unit of q), then
  :func:`descend`: the best cost-lowering single-site change that keeps every row,
  repeated. Typically within 0.1-0.5% of the optimum.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_ext.methods.snip.ilp_arrays import Block

MAX_CELLS = 1 << 22
"""Largest sites x units table the knapsack keeps (8 bytes a cell)."""

TOL = 1e-9
"""Row slack allowed (rows are in fractions of F and of B)."""


def _layout(block: Block) -> np.ndarray:
    """Padded (block sites x max options) matrix of block columns, -1 in padding."""
    local = np.searchsorted(block.sites, block.site)
    first = np.searchsorted(local, np.arange(len(block.sites)))
    slot = np.arange(len(local)) - first[local]
    grid = np.full((len(block.sites), slot.max() + 1), -1)
    grid[local, slot] = np.arange(len(local))
    return grid


def violation(block: Block, act: np.ndarray) -> np.ndarray:
    """Total row violation for row activities ``act`` of shape (rows, ...)."""
    lo = np.array([r.lo for r in block.rows]).reshape(-1, *[1] * (act.ndim - 1))
    hi = np.array([r.hi for r in block.rows]).reshape(lo.shape)
    return (np.maximum(lo - act, 0) + np.maximum(act - hi, 0)).sum(axis=0)


def _units(block: Block) -> tuple[np.ndarray, int] | None:
    """(integer weight per column, units needed) for a one-row ``>=`` block counting FP4
    FLOPs, in units of the FLOPs' greatest common divisor; None when the FLOPs are not
    whole numbers or the table would exceed :data:`MAX_CELLS`."""
    row = block.rows[0]
    if row.flops_scale is None:
        return None
    raw = row.coef * row.flops_scale
    ints = np.rint(raw)
    if not np.allclose(raw, ints, rtol=1e-12, atol=1e-3) or ints.max() >= 2 ** 62:
        return None
    unit = math.gcd(*(int(v) for v in ints if v > 0)) or 1
    need = max(math.ceil(row.lo * row.flops_scale / unit - 1e-6), 0)
    if len(block.sites) * (need + 1) > MAX_CELLS:
        return None
    return (ints // unit).astype(np.int64), need


def knapsack(block: Block, cost: np.ndarray) -> np.ndarray | None:
    """Cheapest pick meeting the block's single ``>=`` row (dynamic programming).

    ``best[c]`` is the least cost of the sites so far with exactly ``c`` units (``c <
    need``) or at least ``need`` units (``c == need``). Option ``j`` of the next site
    (weight ``w``, cost ``q``) turns it into ``best[c - w] + q`` for ``c < need`` and
    ``min(best[need - w:]) + q`` for ``need``; the new ``best`` is the minimum over
    options. Every site's ``best`` is kept, and the pick is read back from them."""
    units = _units(block)
    if units is None:
        return None
    weight, need = units
    options = [(cols, np.minimum(weight[cols], need), cost[cols])
               for cols in (row[row >= 0] for row in _layout(block))]
    history = np.empty((len(options) + 1, need + 1))
    history[0] = np.inf
    history[0, 0] = 0.0
    padded = np.full(2 * need + 1, np.inf)  # padded[need + c] = best[c]; inf below 0
    states = np.arange(need + 1)
    for i, (_, w, q) in enumerate(options):
        padded[need:] = history[i]
        shifted = padded[(need - w)[:, None] + states] + q[:, None]
        suffix = np.minimum.accumulate(history[i, ::-1])[::-1]  # suffix[c] = min(best[c:])
        shifted[:, need] = suffix[need - w] + q
        history[i + 1] = shifted.min(axis=0)
    if not np.isfinite(history[-1, need]):
        return None
    return _read_back(history, options, need)


def _read_back(history: np.ndarray, options, need: int) -> np.ndarray:
    """The columns that reach ``best[need]`` after the last site, site by site backwards."""
    pick, state = np.empty(len(options), dtype=np.int64), need
    for i in range(len(options) - 1, -1, -1):
        cols, w, q = options[i]
        before, target = history[i], history[i + 1, state]
        if state < need:
            reach = np.where(w <= state, before[np.maximum(state - w, 0)], np.inf) + q
        else:
            reach = np.array([before[need - wj:].min() for wj in w]) + q
        j = int(np.argmin(np.abs(reach - target)))
        if state < need:
            state -= int(w[j])
        else:
            state = need - int(w[j]) + int(np.argmin(before[need - w[j]:]))
        pick[i] = cols[j]
    return pick


def activity(block: Block, pick: np.ndarray) -> np.ndarray:
    """Each row's left-hand side for a pick."""
    return np.array([row.coef[pick].sum() for row in block.rows])


def _moves(block: Block, pick: np.ndarray, cost: np.ndarray):
    """For every column as a move (its site switches to it): (cost change, new violation)."""
    coef = np.stack([row.coef for row in block.rows])
    current = pick[np.searchsorted(block.sites, block.site)]
    delta = coef - coef[:, current]
    after = activity(block, pick)[:, None] + delta
    return cost - cost[current], violation(block, after)


def descend(block: Block, cost: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """Apply the best cost-lowering single-site change that keeps every row, until none."""
    local = np.searchsorted(block.sites, block.site)
    for _ in range(4 * len(pick)):
        dq, viol = _moves(block, pick, cost)
        dq = np.where(viol <= TOL, dq, np.inf)
        col = int(np.argmin(dq))
        if dq[col] >= -1e-12:
            break
        pick = pick.copy()
        pick[local[col]] = col
    return pick


def greedy(block: Block, cost: np.ndarray) -> np.ndarray | None:
    """Lagrangian choice for the FLOP row, greedy repair of the others, then descent."""
    layout = _layout(block)
    safe = np.where(layout >= 0, layout, 0)
    pad = layout < 0
    e = block.rows[0].coef

    def choose(lam: float) -> np.ndarray:
        score = np.where(pad, np.inf, cost[safe] - lam * e[safe])
        return safe[np.arange(len(layout)), np.argmin(score, axis=1)]

    hi = 1.0
    while e[choose(hi)].sum() < block.rows[0].lo - TOL and hi < 1e30:
        hi *= 4.0
    lo = 0.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if e[choose(mid)].sum() < block.rows[0].lo - TOL else (lo, mid)
    pick = choose(hi)
    local = np.searchsorted(block.sites, block.site)
    for _ in range(len(pick)):
        now = violation(block, activity(block, pick)[:, None])[0]
        if now <= TOL:
            return descend(block, cost, pick)
        dq, viol = _moves(block, pick, cost)
        gain = now - viol
        ratio = np.where(gain > 1e-15, gain / np.maximum(dq, 1e-12), -np.inf)
        col = int(np.argmax(ratio))
        if not np.isfinite(ratio[col]):
            return None
        pick = pick.copy()
        pick[local[col]] = col
    return None
