"""SNIP's part of ``--dry-run``: the ILP of this exact shape, and what a refresh moves.

**The ILP.** :func:`~megatron_ext.methods.snip.synthetic.synthetic_problem` builds SNIP's
problem (SNIP §5, ``docs/snip.md``) with the run's real site shapes — the cost model's
``ModelShape`` of the run (so GPT's plain MLP is right too), charged for one micro-batch
(``T = s·b``) with the padded vocabulary — its pipeline stages (megatron's split, virtual
chunks included) and random quality losses ``q`` in place of measured statistics. ``solve``
is then timed at ``--snip-budget`` with ``--snip-stage-balance``. Its plan — option names
``x=<fmt>,w=<fmt>,dy=<fmt>`` as in training, each role in the FP4 or the FP8 formats of
``uniform:fp4`` / ``uniform:fp8`` — becomes a PrecisionPlan. For ``--precision
snip`` and the statistics baselines (``min-abs-err``, ``min-rel-err``), whose plans only
training can decide, that plan stands in for the run's (:func:`stand_in_plan`, their
``Policy.dry_run`` hook), so the precision platform's stage times are estimated from what
SNIP would choose at that budget. The problem is solved once per shape and budget: the
report line and the stand-in plan share it.

**Statistics and collectives per refresh.** A refresh turns measured statistics into one
quality-loss estimate per (site, option): ``4`` sites per layer × ``c³`` options, ``c`` the
candidate formats per role (``--snip-candidates``; ``fp8,fp4`` by default: ``2³ = 8``). The
ILP itself is always solved over the eight FP8 / FP4 options of the synthetic problems. Per
GPU of stage ``k`` the statistics are ``4·L_k·c³`` FP32 scalars; they are all-reduced over
the TP group (sums over shards) and averaged over the DP group (same size), gathered over the
PP group to the solving rank (``4·L·c³`` scalars arrive there), and the plan comes back as a
broadcast of one option index (int32) per site plus the plan's sha256.

**Memory per refresh** (:mod:`.memory`): what one GPU of each stage holds beyond a step
(weight snapshot, ``A²``, base ``dw``, float64 sums, the largest site's work) is the
stage's ``extra`` memory in the report, so the dry run's "fits" verdict includes it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megatron_ext.extension import DryRunPart
from megatron_ext.methods.snip.ilp import SolverConfig, solve
from megatron_ext.methods.snip.memory import (GIB, RefreshMemory, local_sites, sums_per_site,
                                              refresh_memory as memory_of)
from megatron_ext.methods.snip.candidates import parse_option_name
from megatron_ext.methods.snip.synthetic import synthetic_problem
from megatron_ext.methods.snip.tensor_store import resolve
from megatron_ext.precision.cost import ModelShape, layer_stages
from megatron_ext.precision.dry_run import micro_batch_shape
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.sites import ROLES, SITES

OPTIONS = 2 ** len(ROLES)
"""Options of the synthetic problem: each of the three roles in FP4 or FP8."""
SCALAR_BYTES = 4
"""FP32 statistics; int32 option indices."""


@dataclass(frozen=True)
class SnipSizes:
    """What one SNIP refresh keeps and moves."""

    sites: int
    """Linear sites of the model (4 per layer)."""
    options: int
    """Candidate options per site."""
    stage_scalars: list[int]
    """Per stage: statistics scalars one GPU holds (= its TP and DP all-reduce size)."""
    gathered_bytes: int
    """Bytes the solving rank receives over the PP gather (all sites × options, FP32)."""
    plan_bytes: int
    """Bytes of the plan broadcast (an int32 option index per site plus a 32-byte hash)."""


@dataclass(frozen=True)
class IlpRun:
    """The ILP solved for this shape with synthetic statistics."""

    budget: float
    """``E_t`` asked for."""
    stage_balance: str
    """Stage rows used."""
    variables: int
    """Binary variables before pruning (sites × options)."""
    status: str
    """``Solution.status``."""
    objective: float
    """Σ q of the plan."""
    fp4_fraction: float
    """Achieved FP4 share of linear FLOPs."""
    stage_fp4_fraction: list[float]
    """Per stage FP4 share."""
    pruned: int
    """Options dropped as dominated."""
    solve_time: float
    """Wall seconds of ``solve``."""


def snip_sizes(config, args, context) -> SnipSizes:
    """Per-refresh statistics and collective sizes (module docstring); options per site are
    (candidates per role) ** 3, from ``--snip-candidates`` (``config``, a ``SnipConfig``)."""
    options = len(config.options)
    sites = len(SITES) * args.num_layers
    stage = [len(SITES) * len(s.layers) * options for s in context.stages]
    return SnipSizes(sites, options, stage, sites * options * SCALAR_BYTES,
                     sites * SCALAR_BYTES + 32)


@functools.lru_cache(maxsize=8)
def _solved(shape: ModelShape, seed: int, budget: float, mode: str):
    """(IlpRun, choice items) of the synthetic problem of ``shape`` (cached: the report line
    and the stand-in plan of one dry run ask for the same solve)."""
    problem = synthetic_problem(shape.num_layers, len(SITES), OPTIONS, shape.pipeline_stages,
                                seed=seed, shape=shape, stage_of=layer_stages(shape))
    sol = solve(problem, budget, mode, SolverConfig())
    variables = sum(len(s.options) for s in problem.sites)
    return (IlpRun(budget, mode, variables, sol.status, sol.objective, sol.fp4_fraction,
                   sol.stage_fp4_fraction, sol.pruned, sol.solve_time),
            tuple(sol.choice.items()))


def solve_for_shape(config, args, shape: ModelShape) -> tuple[IlpRun, dict[str, str]]:
    """The synthetic problem of ``shape`` solved at ``--snip-budget``; (summary, site ->
    option name)."""
    ilp, choice = _solved(shape, args.seed, config.budget, config.stage_balance)
    return ilp, dict(choice)


def plan_from_choice(choice: dict[str, str], budget: float, method: str) -> PrecisionPlan:
    """The PrecisionPlan of an ILP choice (site -> option name)."""
    sites = {site: parse_option_name(name) for site, name in choice.items()}
    return PrecisionPlan(sites, method=method, budget=budget)


def stand_in_plan(config, args, shape: ModelShape) -> PrecisionPlan:
    """``Policy.dry_run`` of SNIP and its statistics baselines: the ILP's plan at
    ``--snip-budget`` for this shape (module docstring); ``config`` is the ``SnipConfig``."""
    method = ("snip (dry run, synthetic statistics)" if config.policy == "snip" else
              f"{config.policy}: stood in for by the SNIP ILP plan at budget "
              f"{config.budget:g}")
    return plan_from_choice(solve_for_shape(config, args, shape)[1], config.budget, method)


def refresh_memory(config, args, context) -> list[RefreshMemory]:
    """Per pipeline stage, what a refresh holds on one GPU beyond a step (:mod:`.memory`;
    ``--snip-offload`` auto and host keep the snapshot, ``A²`` and ``dw`` on the host, disk
    in files)."""
    shape = ModelShape.from_args(args)
    layout = context.layout
    sums = sums_per_site(config.candidates)
    return [memory_of(s.per_gpu, 2 if layout.bf16 else 4,
                      local_sites(shape, s.layers, layout.tp),
                      layout.seq * layout.micro_batch, layout.micro_batches, layout.dp, sums,
                      resolve(config.offload, "cuda"), config.sites_per_pass)
            for s in context.stages]


def estimate(config, args, context) -> DryRunPart:
    """SNIP's part of the report: a refresh's sizes and memory, and the ILP of this shape."""
    ilp, _ = solve_for_shape(config, args, micro_batch_shape(args, context))
    sizes = snip_sizes(config, args, context)
    extra = refresh_memory(config, args, context)
    worst = max(extra, key=lambda m: m.total)
    stages = ", ".join(f"{f:.2f}" for f in ilp.stage_fp4_fraction)
    most = max(4 * len(s.layers) for s in context.stages)
    groups = -(-most // config.sites_per_pass) if config.sites_per_pass else 1
    return DryRunPart(lines=(
        f"SNIP refresh: {sizes.sites} sites x {sizes.options} options; statistics per GPU "
        f"{sizes.stage_scalars[0] * SCALAR_BYTES:,} B (TP all-reduce, DP all-reduce of that "
        f"size), PP gather {sizes.gathered_bytes:,} B to the solver, plan broadcast "
        f"{sizes.plan_bytes:,} B",
        f"SNIP refresh memory per GPU beyond a step (the 'extra' column), largest stage: "
        f"{worst.total / GIB:.2f} GiB = snapshot {worst.snapshot / GIB:.2f} + A² "
        f"{worst.adam / GIB:.2f} + dw {worst.base_grad / GIB:.2f} + float64 sums "
        f"{worst.accumulators / GIB:.2f} + largest site {worst.transient / GIB:.2f}"
        + (f"; on the host (--snip-offload): {worst.host / GIB:.2f} GiB" if worst.host else "")
        + (f"; in files (--snip-offload disk): {worst.disk / GIB:.2f} GiB" if worst.disk else "")
        + f"; {3 * groups} passes per refresh"
        + (f" ({groups} groups of --snip-sites-per-pass {config.sites_per_pass})"
           if config.sites_per_pass else ""),
        f"SNIP ILP (synthetic statistics, budget {ilp.budget:g}, stage balance "
        f"{ilp.stage_balance}): {ilp.status} in {ilp.solve_time:.2f} s, {ilp.variables:,} "
        f"variables ({ilp.pruned:,} pruned), FP4 {ilp.fp4_fraction:.3f}, per stage "
        f"[{stages}], objective {ilp.objective:.1f}"),
        memory=tuple(float(m.total) for m in extra),
        json={"snip": dataclasses.asdict(sizes), "ilp": dataclasses.asdict(ilp),
              "snip_refresh_memory": [dataclasses.asdict(m) for m in extra]})
