"""SNIP step 5 in training: quality table -> ILP problem -> PrecisionPlan, and the baselines.

Every policy — SNIP and the §6.1 baselines — fills one table ``q[site, option]`` and goes
through the same ILP (:func:`megatron_ext.methods.snip.ilp.solve`) at the same budget ``E_t`` and
stage balance, so plans differ only in what they minimise:

==================  ==================================================================
policy              q[site, option]
==================  ==================================================================
``snip``            ΔL + ΔW (:mod:`megatron_ext.methods.snip.divergence`)
``min-abs-err``     Σ_roles ‖δ‖ of the option's formats (quantization error only)
``min-rel-err``     Σ_roles ‖δ‖ / ‖t‖
``random``          uniform random (seeded) x FP4 share of the option
``e-layer-type``    FP4 share x (10 for MLP gate/up ``fc1``, 1 elsewhere): FP8 for fc1 first
``e-layer-id``      FP4 share x (1 + distance from the middle layer): FP4 for middle layers
==================  ==================================================================

Each site's FLOPs and estimated times come from the cost model on the run's device profile
(``--device-profile``, :mod:`megatron_ext.precision.device_profile`; ``nominal``: a GEMM of
``2·T·N·K`` FLOPs runs at the rate of its wider operand, BF16 989 TFLOP/s, FP8 2x, FP4 4x);
each stage's fixed time is its layers' attention core plus, on the last stage, the output
layer, both in BF16 (``stage_fixed_time`` of ``problem.json``).
"""

from __future__ import annotations

import numpy as np

from megatron_ext.precision.cost import ModelShape, layer_stages, site_cost
from megatron_ext.precision.device_profile import DeviceProfile
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.sites import parse_site_id
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.methods.snip.divergence import (Divergence, SiteStats, divergences,
                                           quantization_errors)
from megatron_ext.methods.snip.ilp import Solution, SolverConfig, solve
from megatron_ext.methods.snip.ilp_arrays import fp4_emulated
from megatron_ext.methods.snip.candidates import option_name
from megatron_ext.methods.snip.problem import Option, Problem, Site

STATS_POLICIES = ("snip", "min-abs-err", "min-rel-err")
"""Policies that need measured statistics (a refresh)."""
STATIC_POLICIES = ("random", "e-layer-type", "e-layer-id")
"""Policies that need only the model shape."""


def build_problem(sites: list[str], options: list[SiteFormats], q: np.ndarray,
                  shape: ModelShape, fixed: list[float], meta: dict | None = None,
                  stage_of: list[int] | None = None,
                  profile: DeviceProfile | None = None) -> Problem:
    """The ILP instance for ``q[site, option]`` (``problem.json`` of a refresh): each option's
    FLOPs and time from the cost model (:func:`~megatron_ext.precision.cost.site_cost`),
    ``fixed`` from :func:`~megatron_ext.precision.cost.stage_fixed_seconds`; ``stage_of`` as in
    :func:`~megatron_ext.precision.cost.layer_stages`; times on ``profile`` (default
    ``nominal``)."""
    stages = layer_stages(shape, stage_of)
    out = []
    for i, sid in enumerate(sites):
        layer, name = parse_site_id(sid)
        opts = []
        for j, fmt in enumerate(options):
            cost = site_cost(shape, name, fmt, profile=profile)
            opts.append(Option(option_name(fmt), float(q[i, j]), cost.fp4_flops, cost.flops,
                               cost.seconds))
        out.append(Site(sid, stages[layer], tuple(opts)))
    return Problem(tuple(out), shape.pipeline_stages, tuple(fixed), meta=meta or {},
                   fp4_emulated=fp4_emulated(out))


def quality_table(policy: str, stats: list[SiteStats] | None, options: list[SiteFormats],
                  loss: float = 1.0, hyper: dict | None = None, shape: ModelShape | None = None,
                  seed: int = 0, weights: tuple[float, float] = (1.0, 1.0)) -> np.ndarray:
    """``q[site, option]`` of ``policy`` (see the module docstring)."""
    if policy == "snip":
        return divergence_q(divergences(stats, options, loss, hyper, *weights))
    if policy in ("min-abs-err", "min-rel-err"):
        rel = policy == "min-rel-err"
        return np.array([[quantization_errors(s, o, rel) for o in options] for s in stats])
    return _static_table(policy, options, shape, seed)


def divergence_q(table: list[list[Divergence]]) -> np.ndarray:
    """``q[site, option]`` of a :func:`~megatron_ext.methods.snip.divergence.divergences` table."""
    return np.array([[d.q for d in row] for row in table])


def _static_table(policy: str, options: list[SiteFormats], shape: ModelShape,
                  seed: int) -> np.ndarray:
    layers, names = shape.num_layers, ("qkv", "proj", "fc1", "fc2")
    costs = [site_cost(shape, "qkv", o) for o in options]
    share = np.array([c.fp4_flops / c.flops for c in costs])
    if policy == "random":
        rng = np.random.default_rng(seed)
        return rng.random((layers * len(names), len(options))) * (share + 1e-3)
    middle = (layers - 1) / 2
    weight = [_site_weight(policy, layer, name, middle)
              for layer in range(layers) for name in names]
    return np.outer(weight, share + 1e-3)


def _site_weight(policy: str, layer: int, name: str, middle: float) -> float:
    if policy == "e-layer-type":
        return 10.0 if name == "fc1" else 1.0
    if policy == "e-layer-id":
        return 1.0 + abs(layer - middle)
    raise ValueError(f"unknown policy {policy!r}")


def plan_from_solution(solution: Solution, options: list[SiteFormats], method: str,
                       step: int) -> PrecisionPlan:
    by_name = {option_name(o): o for o in options}
    sites = {sid: by_name[name] for sid, name in solution.choice.items()}
    return PrecisionPlan(sites, method=method, step=step, budget=solution.budget,
                         objective=solution.objective,
                         stage_fp4_frac=solution.stage_fp4_fraction)


def make_plan(problem: Problem, options: list[SiteFormats], method: str, step: int,
              budget: float, stage_balance: str, config: SolverConfig,
              warm: dict[str, str] | None = None) -> tuple[PrecisionPlan, Solution]:
    """Solve ``problem`` and turn the choice into a plan."""
    solution = solve(problem, budget, stage_balance, config, warm)
    return plan_from_solution(solution, options, method, step), solution
