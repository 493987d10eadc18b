"""One block of the ILP through HiGHS (``highspy``): options, model, start, outcome.

The block's matrix goes over in a single ``passModel`` call (column-wise, built with numpy
by :func:`~megatron_ext.methods.snip.ilp_arrays.csc`); a starting plan goes over with ``setSolution``,
and then HiGHS's own primal heuristics are switched off (with a good start they cost more
than they find on these knapsacks). Row and integrality tolerances are
:data:`~megatron_ext.methods.snip.incumbent.TOL`, so a plan HiGHS accepts meets every row to 1e-9
of the FLOPs or of the stage-time bound.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import highspy
import numpy as np

from megatron_ext.methods.snip.incumbent import TOL
from megatron_ext.methods.snip.ilp_arrays import Block, csc

_QUIET_HEURISTICS = {"mip_heuristic_effort": 0.0, "mip_heuristic_run_rins": False,
                     "mip_heuristic_run_rens": False,
                     "mip_heuristic_run_feasibility_jump": False,
                     "mip_heuristic_run_root_reduced_cost": False}

_scheduler_threads: list[int] = []
"""Thread count HiGHS's process-wide scheduler was started with (it must be reset to
change)."""


@dataclass(frozen=True)
class BlockResult:
    """What one block's solve gave."""

    status: str
    """``optimal`` / ``feasible`` (with a plan) or ``timeout`` / ``infeasible`` / ``error``."""
    pick: np.ndarray | None = None
    """Chosen block column per block site."""
    objective: float = math.nan
    """Σ q of the pick."""
    bound: float = -math.inf
    """HiGHS's proven lower bound on the block's optimum."""
    detail: str = ""
    """HiGHS's model status, for messages."""


def _swallow_banner() -> None:
    """highspy prints a two-line banner on the C-level stdout when a process makes its first
    ``Highs`` (whatever ``output_flag`` says later); make that first one here, at import, in
    the main thread, with fd 1 pointed at /dev/null."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


_swallow_banner()


def _highs(time_limit: float, mip_gap: float, threads: int, quiet: bool) -> highspy.Highs:
    if _scheduler_threads != [threads]:
        highspy.Highs.resetGlobalScheduler(True)
        _scheduler_threads[:] = [threads]
    h = highspy.Highs()
    options = {"output_flag": False, "time_limit": float(time_limit),
               "mip_rel_gap": float(mip_gap), "mip_abs_gap": 0.0, "threads": int(threads),
               "mip_feasibility_tolerance": TOL, "primal_feasibility_tolerance": TOL,
               **(_QUIET_HEURISTICS if quiet else {})}
    for name, value in options.items():
        h.setOptionValue(name, value)
    return h


def run_highs(block: Block, cost: np.ndarray, start: np.ndarray | None, time_limit: float,
              mip_gap: float, threads: int) -> BlockResult:
    """Solve one block with HiGHS from ``start`` (a feasible pick, or None)."""
    h = _highs(time_limit, mip_gap, threads, quiet=start is not None)
    a_start, index, value, row_lo, row_hi = csc(block)
    n = len(cost)
    h.passModel(n, len(row_lo), len(index), int(highspy.MatrixFormat.kColwise),
                int(highspy.ObjSense.kMinimize), 0.0, cost, np.zeros(n), np.ones(n),
                row_lo, row_hi, a_start, index, value, np.ones(n, dtype=np.int32))
    if start is not None:
        x = np.zeros(n)
        x[start] = 1.0
        solution = highspy.HighsSolution()
        solution.col_value = x.tolist()
        solution.value_valid = True
        h.setSolution(solution)
    ran = h.run()
    return _outcome(h, block, ran == highspy.HighsStatus.kError)


def _outcome(h: highspy.Highs, block: Block, error: bool) -> BlockResult:
    model_status, info = h.getModelStatus(), h.getInfo()
    detail = h.modelStatusToString(model_status)
    if not error and info.primal_solution_status == int(highspy.kSolutionStatusFeasible):
        pick = np.flatnonzero(np.asarray(h.getSolution().col_value) > 0.5)
        if np.array_equal(block.site[pick], block.sites):
            optimal = model_status == highspy.HighsModelStatus.kOptimal
            return BlockResult("optimal" if optimal else "feasible", pick,
                               float(info.objective_function_value),
                               float(info.mip_dual_bound), detail)
    if not error and model_status == highspy.HighsModelStatus.kTimeLimit:
        return BlockResult("timeout", detail=detail)
    if not error and model_status == highspy.HighsModelStatus.kInfeasible:
        return BlockResult("infeasible", detail=detail)
    return BlockResult("error", detail=f"HiGHS: {detail}")
