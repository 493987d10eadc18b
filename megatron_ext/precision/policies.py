"""Policies: ``--precision NAME[:ARG]`` -> a :class:`Policy` -> a PrecisionPlan.

A policy is brought into a run by the extension that owns it, as a field of its Extension
(``Extension(..., policies=(Policy("toy", make_toy_plan, help="...", owner="toy"),))``); the
precision platform offers the policies of the run's extensions and its own ``uniform``, no
others (:class:`PolicySet`): a policy whose owner is not in the run cannot be chosen, and
``--precision`` names it as unknown with the list of those that are.

``make(args, arg)`` builds the **base plan** the run starts from (``arg`` is the text after the
colon, or None); its owner's settings come from the owner's frozen config (a closure over the
owner's per-run state). A policy that decides during training (SNIP refreshes) starts from a
safe plan and later replaces the base through the plan controller (:mod:`.controller`).

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
* any other ``megatron_ext.formats`` name (``mxfp4``, ``nvfp4``, ``mxfp8``, ``fp8_e4m3@row``,
  ``int8@tile128``, ``nvfp4+sr``, ...) — that one format for all three operands (``+sr``, too).
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
from megatron_ext.precision.site_formats import PASSTHROUGH, SiteFormats, normalize_format
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
    """The extension that brings it (its extension validates its flags)."""
    open_arg: str = ""
    """Besides ``args``: a placeholder (``<format>``) for any ``ARG`` that :attr:`accepts`;
    empty: only ``args``."""
    accepts: Callable[[str], bool] | None = None
    """``accepts(arg)`` -> whether an ``ARG`` outside ``args`` is valid (with ``open_arg``)."""
    dry_run: Callable[..., PrecisionPlan] | None = None
    """``dry_run(args, shape)`` -> the plan ``--dry-run`` assumes, for a policy whose plan
    only training can decide (None: ``make``'s plan is used); ``shape`` is the run's
    ``cost.ModelShape`` charged for one micro-batch, with the padded vocabulary
    (:mod:`.dry_run`)."""

    def spellings(self) -> list[str]:
        args = [*self.args, *([self.open_arg] if self.open_arg else [])]
        return [f"{self.name}:{arg}" for arg in args] or [self.name]

    def takes(self, arg: str) -> bool:
        """Whether ``ARG`` (the text after the colon) is one this policy accepts."""
        return arg in self.args or bool(self.accepts and arg and self.accepts(arg))


class PolicySet:
    """The policies one run offers, by name (the platform's ``uniform`` and its extensions')."""

    def __init__(self, policies=()):
        self.by_name: dict[str, Policy] = {}
        """Name -> policy."""
        for policy in (UNIFORM_POLICY, *policies):
            known = self.by_name.get(policy.name)
            if known is not None and known is not policy:
                raise ValueError(f"policy {policy.name!r} is brought by {known.owner} and "
                                 f"{policy.owner}")
            self.by_name[policy.name] = policy

    def choices(self) -> list[str]:
        """Every accepted ``--precision`` spelling."""
        return [s for name in sorted(self.by_name) for s in self.by_name[name].spellings()]

    def lookup(self, spec: str) -> tuple[Policy, str | None]:
        """The policy ``--precision spec`` names and its argument; ``ValueError`` if unknown."""
        name, colon, arg = spec.partition(":")
        policy = self.by_name.get(name)
        if policy is None or (not policy.takes(arg) if policy.args or policy.open_arg else colon):
            raise ValueError(f"unknown precision {spec!r} in this run; choose one of "
                             f"{', '.join(self.choices())}")
        return policy, (arg if colon else None)

    def make_plan(self, spec: str, args: argparse.Namespace) -> PrecisionPlan:
        """The base plan of ``--precision spec``."""
        policy, arg = self.lookup(spec)
        return policy.make(args, arg)


def uniform_formats(recipe: str) -> SiteFormats:
    """``UNIFORM[recipe]``, else the format ``recipe`` names for all three operands
    (``ValueError`` if it names none)."""
    return UNIFORM.get(recipe) or SiteFormats(recipe, recipe, recipe)


def _is_format(name: str) -> bool:
    try:
        return normalize_format(name) != PASSTHROUGH
    except ValueError:
        return False


def uniform_plan(recipe: str, num_layers: int) -> PrecisionPlan:
    """Every site of a ``num_layers``-layer model in :func:`uniform_formats` of ``recipe``."""
    formats = uniform_formats(recipe)
    return PrecisionPlan({sid: formats for sid in all_site_ids(num_layers)},
                         method=f"uniform:{recipe}")


def keep_overlay(count: int, num_layers: int) -> Overlay:
    """``--keep-first-last-layers-bf16 count``: the overlay ``precision/keep<count>bf16`` that
    sets every site of the first and last ``count`` layers to BF16."""
    kept = [layer for layer in range(num_layers) if layer < count or layer >= num_layers - count]
    return Overlay("precision", f"keep{count}bf16",
                   {site_id(layer, s): HIGH_PRECISION for layer in kept for s in SITES})


UNIFORM_POLICY = Policy("uniform", lambda args, arg: uniform_plan(arg, args.num_layers),
                        help="every site alike", args=tuple(UNIFORM), open_arg="<format>",
                        accepts=_is_format)
"""The platform's own policy, offered in every run."""
