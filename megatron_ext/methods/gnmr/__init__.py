"""GNMR (paper ``shared/papers/001_683f8b3565149dd9.txt``): promote the units whose gradient
norm jumps to high precision for a few steps, under a budget.

* :mod:`.algorithm` — Algorithm 1: GNMR and Δ-GNMR, vectorised over units, O(1) state;
* :mod:`.decisions` — Algorithm 2: thresholds, lock, maxO budget, schedule, non-finite steps
  (:class:`~.decisions.GnmrConfig`, :class:`~.decisions.GnmrController`);
* :mod:`.rules` — the baselines of ``--gnmr-rule`` (first-last, static-topk, autoswitch);
* :mod:`.operand_stats` — autoswitch's underflow / MSE of every low-precision GEMM operand;
* :mod:`.units` — unit ids and the one-all-reduce norm reduction over TP / PP / DP;
* :mod:`.promote` — the formats a promoted site runs in;
* :mod:`.memory` — App. D's peak-memory bound for maxO promoted units.

The modules are imported one by one (no re-exports here), so the controller's import stays
free of torch. See ``docs/gnmr.md``.
"""
