"""The one policy registry: ``--precision NAME[:ARG]`` -> a :class:`Policy` -> a PrecisionPlan.

A policy is registered once, at import, by the package that owns it (``uniform`` here, SNIP's
seven in ``megatron_ext.methods.snip``; a new method registers its own the same way)::

    register_policy(Policy("toy", make_toy_plan, help="..."))

``make(args, arg)`` builds the **base plan** the run starts from (``arg`` is the text after the
colon, or None); it may read the owning method's flags, which that method's extension has
validated. A policy that decides during training (SNIP refreshes) starts from a safe plan and
later replaces the base through the plan controller (:mod:`.controller`).

``uniform:<recipe>`` gives every site the same formats:

* ``bf16`` — every operand rounded to BF16 (a no-op in a BF16 run; emulates BF16 GEMMs in an
  FP32 run);
* ``fp8`` — DeepSeek-V3's recipe: E4M3 everywhere, 1x128 tiles for ``x`` and ``dy``, 128x128
  blocks for ``w``;
* ``fp4`` — the same layout in E2M1, with stochastic rounding for ``dy`` (SNIP §6.1: "When
  applying the FP4 format to output gradients, we utilize stochastic rounding"; ``x`` and
  ``w`` round to nearest);
* ``fp4-tensor`` — E2M1 with one scale per tensor and round-to-nearest for every operand: the
  harsh recipe of the comparison regime (``docs/compare.md``), where uniform FP4 ends ~7 %
  above FP32 on the tiny Llama instead of ~0.6 %;
* ``wgrad-x4-token`` / ``wgrad-x8-token`` — GNMR §5.1's activation quantization: only the
  activation the weight gradient reads (``wgrad.x``, the one a linear saves for its backward)
  in E2M1 / E4M3 with one scale per token (``@col`` along the tokens), every other operand
  unquantized (the run's own precision).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from megatron_ext.precision.controller import Overlay
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.sites import SiteFormats
from megatron_ext.sites import SITES, all_site_ids, site_id

UNIFORM = {
    "bf16": SiteFormats("bf16", "bf16", "bf16"),
    "fp8": SiteFormats("fp8_e4m3@tile128", "fp8_e4m3@block128", "fp8_e4m3@tile128"),
    "fp4": SiteFormats("fp4_e2m1@tile128", "fp4_e2m1@block128", "fp4_e2m1@tile128+sr"),
    "fp4-tensor": SiteFormats("fp4_e2m1", "fp4_e2m1", "fp4_e2m1"),
    "wgrad-x4-token": SiteFormats("none", "none", "none",
                                  overrides=(("wgrad.x", "fp4_e2m1@col"),)),
    "wgrad-x8-token": SiteFormats("none", "none", "none",
                                  overrides=(("wgrad.x", "fp8_e4m3@col"),)),
}
"""The ``uniform:<recipe>`` site formats (module docstring)."""

HIGH_PRECISION = UNIFORM["bf16"]
"""What ``--keep-first-last-layers-bf16`` gives the kept layers."""


@dataclass(frozen=True)
class Policy:
    """One way to make a run's base plan from the flags."""

    name: str
    """``NAME`` in ``--precision NAME[:ARG]``."""
    make: Callable[[argparse.Namespace, str | None], PrecisionPlan]
    """``make(args, arg)`` -> the base plan (``ValueError`` for a bad one)."""
    help: str
    """One phrase for ``--help``."""
    args: tuple[str, ...] = ()
    """The ``ARG`` values accepted after the colon; empty: the policy takes none."""
    owner: str = "precision"
    """The method that registered it (its extension validates its flags)."""
    dry_run: Callable[..., PrecisionPlan] | None = None
    """``dry_run(args, shape)`` -> the plan ``--dry-run`` assumes, for a policy whose plan
    only training can decide (None: ``make``'s plan is used); ``shape`` is the run's
    ``cost.ModelShape`` charged for one micro-batch, with the padded vocabulary
    (:mod:`.dry_run`)."""

    def spellings(self) -> list[str]:
        return [f"{self.name}:{arg}" for arg in self.args] or [self.name]


POLICIES: dict[str, Policy] = {}
"""Registered policies by name."""


def register_policy(policy: Policy) -> Policy:
    """Add ``policy``; ``ValueError`` if another owner registered the name already."""
    known = POLICIES.get(policy.name)
    if known is not None and known.owner != policy.owner:
        raise ValueError(f"policy {policy.name!r} is registered by {known.owner} already")
    POLICIES[policy.name] = policy
    return policy


def policy_choices() -> list[str]:
    """Every accepted ``--precision`` spelling."""
    return [s for name in sorted(POLICIES) for s in POLICIES[name].spellings()]


def lookup(spec: str) -> tuple[Policy, str | None]:
    """The policy ``--precision spec`` names and its argument; ``ValueError`` if unknown."""
    name, colon, arg = spec.partition(":")
    policy = POLICIES.get(name)
    if policy is None or (arg not in policy.args if policy.args else colon):
        raise ValueError(f"unknown precision {spec!r}; choose one of {', '.join(policy_choices())}")
    return policy, (arg if colon else None)


def make_plan(spec: str, args: argparse.Namespace) -> PrecisionPlan:
    """The base plan of ``--precision spec``."""
    policy, arg = lookup(spec)
    return policy.make(args, arg)


def uniform_plan(recipe: str, num_layers: int) -> PrecisionPlan:
    """Every site of a ``num_layers``-layer model in ``UNIFORM[recipe]``."""
    formats = UNIFORM[recipe]
    return PrecisionPlan({sid: formats for sid in all_site_ids(num_layers)},
                         method=f"uniform:{recipe}")


def keep_overlay(count: int, num_layers: int) -> Overlay:
    """``--keep-first-last-layers-bf16 count``: the overlay ``precision/keep<count>bf16`` that
    sets every site of the first and last ``count`` layers to BF16."""
    kept = [layer for layer in range(num_layers) if layer < count or layer >= num_layers - count]
    return Overlay("precision", f"keep{count}bf16",
                   {site_id(layer, s): HIGH_PRECISION for layer in kept for s in SITES})


register_policy(Policy("uniform", lambda args, arg: uniform_plan(arg, args.num_layers),
                       help="every site alike", args=tuple(UNIFORM)))
