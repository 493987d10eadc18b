"""SNIP (arXiv 2602.01410): choose each linear site's precision to minimise estimated
quality loss under an FP4 FLOP budget.

* :mod:`.problem` — the ILP's input as plain data (sites, options, stages; JSON);
* :mod:`.ilp` — the ILP (eq. 1-5 and a per-stage time cap) and :func:`solve`; helped by
  :mod:`.ilp_arrays` (arrays, pruning, blocks), :mod:`.incumbent` (starting plans) and
  :mod:`.highs` (HiGHS glue);
* :mod:`.synthetic` — problems of a model shape with random quality losses (tests,
  benchmarks, the dry run); :mod:`.dry_run` — SNIP's part of ``--dry-run``.

See ``docs/snip.md``.
"""

from megatron_ext.methods.snip.ilp import Solution, SolverConfig, safe_plan, solve
from megatron_ext.methods.snip.problem import Option, Problem, Site

__all__ = ["Option", "Problem", "Site", "Solution", "SolverConfig", "safe_plan", "solve"]
