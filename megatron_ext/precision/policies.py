"""Policies that make a PrecisionPlan from the flags: ``--precision <policy>:<arg>``.

``uniform:<recipe>`` gives every site the same formats:

* ``bf16`` — every operand rounded to BF16 (a no-op in a BF16 run; emulates BF16 GEMMs in an
  FP32 run);
* ``fp8`` — DeepSeek-V3's recipe: E4M3 everywhere, 1x128 tiles for ``x`` and ``dy``, 128x128
  blocks for ``w``;
* ``fp4`` — the same layout in E2M1, with stochastic rounding for ``dy`` (SNIP §6.1: "When
  applying the FP4 format to output gradients, we utilize stochastic rounding"; ``x`` and
  ``w`` round to nearest).

:func:`keep_layers_bf16` then lifts the first and last N layers to BF16
(``--keep-first-last-layers-bf16 N``). Later policies (SNIP, PGQ, ...) register here too.
"""

from __future__ import annotations

from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.sites import SITES, site_id
from megatron_ext.precision.sites import SiteFormats

UNIFORM = {
    "bf16": SiteFormats("bf16", "bf16", "bf16"),
    "fp8": SiteFormats("fp8_e4m3@tile128", "fp8_e4m3@block128", "fp8_e4m3@tile128"),
    "fp4": SiteFormats("fp4_e2m1@tile128", "fp4_e2m1@block128", "fp4_e2m1@tile128+sr"),
}
"""The ``uniform:<recipe>`` site formats."""

HIGH_PRECISION = UNIFORM["bf16"]
"""What ``--keep-first-last-layers-bf16`` gives the kept layers."""


def uniform_plan(recipe: str, num_layers: int) -> PrecisionPlan:
    """Every site of a ``num_layers``-layer model in ``UNIFORM[recipe]``."""
    formats = UNIFORM[recipe]
    sites = {site_id(layer, s): formats for layer in range(num_layers) for s in SITES}
    return PrecisionPlan(sites, method=f"uniform:{recipe}")


POLICIES = {"uniform": (uniform_plan, tuple(UNIFORM))}
"""policy name -> (maker(arg, num_layers), accepted args)."""


def policy_choices() -> list[str]:
    return [f"{name}:{arg}" for name, (_, args) in POLICIES.items() for arg in args]


def plan_from_spec(spec: str, num_layers: int) -> PrecisionPlan:
    """The plan ``--precision spec`` asks for; ``ValueError`` for an unknown spec."""
    name, _, arg = spec.partition(":")
    maker, args = POLICIES.get(name, (None, ()))
    if arg not in args:
        raise ValueError(f"unknown precision {spec!r}; choose one of {', '.join(policy_choices())}")
    return maker(arg, num_layers)


def keep_layers_bf16(plan: PrecisionPlan, count: int, num_layers: int) -> PrecisionPlan:
    """``plan`` with every site of the first and the last ``count`` layers in BF16."""
    kept = [layer for layer in range(num_layers) if layer < count or layer >= num_layers - count]
    sites = dict(plan.sites)
    sites.update({site_id(layer, s): HIGH_PRECISION for layer in kept for s in SITES})
    suffix = f"+keep{count}bf16" if count else ""
    return plan.replace(sites=sites, method=plan.method + suffix)
