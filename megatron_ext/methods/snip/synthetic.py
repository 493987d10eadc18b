"""Synthetic SNIP problems for a model shape: real FLOPs and times, random quality losses.

Used by the tests, ``benchmarks/ilp.py`` and SNIP's part of ``--dry-run``. Each site
``L{i}.{qkv|proj|fc1|fc2}`` runs three GEMMs of ``2·T·N·K`` FLOPs each (fprop reads x, w; dgrad
dy, w; wgrad dy, x). An option puts a subset of the roles {x, w, dy} in FP4 and the rest in
FP8 (the formats of ``uniform:fp4`` / ``uniform:fp8``, :func:`roles_formats`), named as in
training (:func:`~megatron_ext.methods.snip.candidates.option_name`); a GEMM runs in
FP4 only when both of its operands are FP4 (a GEMM runs at its wider operand's rate), so

    FP4 roles     FP4 GEMMs        fp4_flops / flops
    none          -                0
    x, w, dy      all three        1
    two roles     the one reading  1/3    (x+w, w+dy, x+dy)
    one role      none             0      (x, w, dy: dominated by none)

FLOPs, times and each stage's fixed time (attention core of its layers, plus the output layer
on the last stage, both BF16) are the cost model's (:mod:`megatron_ext.precision.cost`, at its
H100-like BF16 rate; FP8 2x, FP4 4x). ``q`` of an option is a small FP8 floor plus, per role
run in FP4, a log-normal per-site sensitivity (first and last layers and ``fc2`` drawn more
sensitive), with 10% noise per option.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_ext.methods.snip import candidates
from megatron_ext.methods.snip.problem import Option, Problem, Site
from megatron_ext.precision.cost import ModelShape, site_cost, stage_fixed_seconds
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.sites import ROLES, SITES

_OPTION_ROLES = ((), ("x", "w", "dy"), ("x", "w"), ("w", "dy"), ("x", "dy"),
                 ("x",), ("w",), ("dy",))


def _llama(layers: int, hidden: int, ffn: int, heads: int, groups: int, vocab: int,
           seq: int) -> ModelShape:
    """A SwiGLU / GQA shape charged for one sequence (``T = s``)."""
    return ModelShape(layers, hidden, ffn, heads, groups, swiglu=True, tokens=seq,
                      seq_length=seq, vocab_size=vocab)


SHAPES = {
    "llama3-70b": _llama(80, hidden=8192, ffn=28672, heads=64, groups=8, vocab=128256, seq=8192),
    "llama3-8b": _llama(32, hidden=4096, ffn=14336, heads=32, groups=8, vocab=128256, seq=8192),
    "tinyllama": _llama(22, hidden=2048, ffn=5632, heads=32, groups=4, vocab=32000, seq=2048),
}
"""Named shapes (``synthetic_problem`` replaces their layer and stage counts)."""


def roles_formats(fp4_roles: tuple[str, ...]) -> SiteFormats:
    """The option with ``fp4_roles`` in FP4 and the other roles in FP8."""
    return SiteFormats(**{r: getattr(UNIFORM["fp4" if r in fp4_roles else "fp8"], r)
                          for r in ROLES})


def option_name(fp4_roles: tuple[str, ...]) -> str:
    """Its name: ``x=<fmt>,w=<fmt>,dy=<fmt>``, the one spelling training's plans use too."""
    return candidates.option_name(roles_formats(fp4_roles))


def stage_of_layers(num_layers: int, stages: int) -> list[int]:
    """Stage of each layer: contiguous blocks, the first ``num_layers % stages`` stages one
    layer longer (TinyLlama's 22 layers on 4 stages: 6, 6, 5, 5)."""
    return [int(k) for k, block in enumerate(np.array_split(np.arange(num_layers), stages))
            for _ in block]


def synthetic_problem(num_layers: int, sites_per_layer: int = 4, options: int = 8,
                      stages: int = 1, seed: int = 0, shape: str | ModelShape = "llama3-70b",
                      stage_of: list[int] | None = None) -> Problem:
    """A problem for ``num_layers`` layers of ``shape`` (a name of :data:`SHAPES` or a
    :class:`~megatron_ext.precision.cost.ModelShape`, charged for its ``tokens``) split into
    ``stages`` (:func:`stage_of_layers`, or ``stage_of`` per layer); the first
    ``sites_per_layer`` sites of (qkv, proj, fc1, fc2) and the first ``options`` options of
    FP4 roles (none, all, x+w, w+dy, x+dy, x, w, dy) per site."""
    if not 1 <= sites_per_layer <= len(SITES):
        raise ValueError(f"sites_per_layer must be 1..{len(SITES)}, got {sites_per_layer}")
    if not 1 <= options <= len(_OPTION_ROLES):
        raise ValueError(f"options must be 1..{len(_OPTION_ROLES)}, got {options}")
    if not 1 <= stages <= num_layers:
        raise ValueError(f"stages must be 1..num_layers, got {stages}")
    shape = dataclasses.replace(SHAPES[shape] if isinstance(shape, str) else shape,
                                num_layers=num_layers, pipeline_stages=stages,
                                layers_per_virtual_stage=None)
    stage_of = stage_of_layers(num_layers, stages) if stage_of is None else stage_of
    fixed = stage_fixed_seconds(shape, stage_of=stage_of)  # checks stage_of
    roles_of = _OPTION_ROLES[:options]
    costs = {name: [site_cost(shape, name, roles_formats(roles))
                    for roles in roles_of] for name in SITES[:sites_per_layer]}
    rng = np.random.default_rng(seed)
    sites = []
    for layer in range(num_layers):
        edge = 3.0 if layer in (0, num_layers - 1) else 1.0
        for name in SITES[:sites_per_layer]:
            scale = edge * (2.0 if name == "fc2" else 1.0)
            sens = dict(zip(("x", "w", "dy"), scale * rng.lognormal(0.0, 1.0, 3)))
            floor = 0.01 * rng.random()
            opts = []
            for roles, cost in zip(roles_of, costs[name]):
                q = floor + sum(sens[r] for r in roles) * (1 + 0.1 * rng.standard_normal())
                opts.append(Option(option_name(roles), float(q), cost.fp4_flops, cost.flops,
                                   cost.seconds))
            sites.append(Site(f"L{layer}.{name}", stage_of[layer], tuple(opts)))
    return Problem(tuple(sites), stages, tuple(fixed),
                   meta={"synthetic": {"num_layers": num_layers, "seed": seed,
                                       "sites_per_layer": sites_per_layer, "options": options}})
