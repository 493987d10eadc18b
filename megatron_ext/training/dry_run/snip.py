"""The SNIP part of a dry run: the ILP of this exact shape, and what a refresh moves.

**The ILP.** ``megatron_ext.methods.snip.synthetic.synthetic_problem`` builds SNIP's problem (SNIP
§5, ``docs/snip.md``) with the run's real site shapes — ``(N, K)`` of every site from
``megatron_ext.precision.cost.ModelShape`` (so GPT's plain MLP is right too), ``T = s·b``
tokens per micro-batch — its pipeline stages (megatron's split, virtual chunks included)
and random quality losses ``q`` in place of measured statistics. ``solve`` is then timed at
``--snip-budget`` (0.5 when that flag is absent) with ``--snip-stage-balance`` (``paper``
when absent). Its plan — option names such as ``fp4:x+w`` — becomes a PrecisionPlan (roles
named after ``fp4`` in FP4, the others in FP8, the formats of ``uniform:fp4`` /
``uniform:fp8``), so the stage times of a SNIP run are estimated from what SNIP would choose.

**Statistics and collectives per refresh.** A refresh turns measured statistics into one
quality-loss estimate per (site, option): ``4`` sites per layer × ``c³`` options, ``c`` the
candidate formats per role (``--snip-candidates``; ``fp8,fp4`` by default: ``2³ = 8``). The
ILP itself is always solved over the eight FP8 / FP4 options of the synthetic problems. Per GPU of stage ``k`` the statistics are
``4·L_k·8`` FP32 scalars; they are all-reduced over the TP group (sums over shards) and
averaged over the DP group (same size), gathered over the PP group to the solving rank
(``4·L·8`` scalars arrive there), and the plan comes back as a broadcast of one option index
(int32) per site plus the plan's sha256. The raw per-row norms accumulated while collecting
(ARCHITECTURE.md: one value per row) stay on their GPU and are not counted here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ext.precision.cost import ModelShape
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.sites import ROLES
from megatron_ext.precision.sites import SiteFormats
from megatron_ext.methods.snip import SolverConfig, solve
from megatron_ext.methods.snip.synthetic import LlamaShape, synthetic_problem

SITES_PER_LAYER = 4
"""qkv, proj, fc1, fc2."""
OPTIONS = 2**3
"""Options of the synthetic problem: each of the three roles in FP4 or FP8."""
SCALAR_BYTES = 4
"""FP32 statistics; int32 option indices."""
DEFAULT_BUDGET = 0.5
"""FP4 FLOP fraction asked for when ``--snip-budget`` does not exist or is unset."""


@dataclass(frozen=True)
class _RunShape(LlamaShape):
    """``LlamaShape`` whose site shapes come from the run's flags (GPT's MLP included)."""

    model: ModelShape | None = None
    """The cost model's shape; supplies ``site_nk``."""

    def site_nk(self, site: str) -> tuple[int, int]:
        return self.model.site_nk(site)


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


def option_count(args) -> int:
    """Options per site: (candidate formats per role) ** 3, from ``--snip-candidates`` when
    that flag exists (a comma-separated list), else ``2 ** 3``."""
    candidates = getattr(args, "snip_candidates", None)
    per_role = len([c for c in str(candidates).split(",") if c.strip()]) if candidates else 2
    return per_role ** len(ROLES)


def snip_sizes(args) -> SnipSizes:
    """Per-refresh statistics and collective sizes (module docstring)."""
    layers = args.num_layers // args.pipeline_model_parallel_size
    sites, options = SITES_PER_LAYER * args.num_layers, option_count(args)
    stage = [SITES_PER_LAYER * layers * options] * args.pipeline_model_parallel_size
    return SnipSizes(sites, options, stage, sites * options * SCALAR_BYTES,
                     sites * SCALAR_BYTES + 32)


def _problem(args, vocab: int):
    cost = ModelShape.from_args(args)
    shape = _RunShape(args.hidden_size, args.ffn_hidden_size, args.num_attention_heads,
                      args.num_query_groups, vocab, args.seq_length, args.micro_batch_size,
                      model=cost)
    problem = synthetic_problem(args.num_layers, SITES_PER_LAYER, OPTIONS,
                                args.pipeline_model_parallel_size, seed=args.seed, shape=shape)
    if cost.layers_per_virtual_stage is None:
        return problem
    sites = tuple(dataclasses.replace(s, stage=cost.stage_of(int(s.site[1:].split(".")[0])))
                  for s in problem.sites)
    return dataclasses.replace(problem, sites=sites)


def solve_for_shape(args, vocab: int) -> tuple[IlpRun, dict[str, str]]:
    """Solve the synthetic problem of this shape; (summary, site -> option name)."""
    budget = getattr(args, "snip_budget", None)
    budget = DEFAULT_BUDGET if budget is None else budget
    mode = getattr(args, "snip_stage_balance", None) or "paper"
    problem = _problem(args, vocab)
    sol = solve(problem, budget, mode, SolverConfig())
    variables = sum(len(s.options) for s in problem.sites)
    return IlpRun(budget, mode, variables, sol.status, sol.objective, sol.fp4_fraction,
                  sol.stage_fp4_fraction, sol.pruned, sol.solve_time), sol.choice


def option_formats(name: str) -> SiteFormats:
    """``fp8`` / ``fp4`` / ``fp4:x+w`` ... -> formats: roles named in FP4, the rest FP8."""
    fp4_roles = set(ROLES) if name == "fp4" else set(name.partition(":")[2].split("+")) - {""}
    pick = {r: getattr(UNIFORM["fp4" if r in fp4_roles else "fp8"], r) for r in ROLES}
    return SiteFormats(**pick)


def plan_from_choice(choice: dict[str, str], budget: float) -> PrecisionPlan:
    """The PrecisionPlan of an ILP choice (site -> option name)."""
    sites = {site: option_formats(name) for site, name in choice.items()}
    return PrecisionPlan(sites, method="snip (dry run, synthetic statistics)", budget=budget)
