"""Candidate formats and the options SNIP chooses among.

``--snip-candidates`` lists formats; each entry is a recipe of :data:`~megatron_ext.precision.
policies.UNIFORM` (``fp8``, ``fp4``, ``bf16``: DeepSeek-V3 layout, 1x128 tiles for ``x`` and
``dy``, 128x128 blocks for ``w``, stochastic rounding for FP4 ``dy``) or any format name of
:mod:`megatron_ext.formats` (then used as is for all three roles, e.g.
``fp8_e4m3@tile128,fp4_e2m1@tile128``), or ``none``: the run's own precision, unquantized. An **option** of a site picks one candidate per role
(x, w, dy), so ``C`` candidates give ``C**3`` options: the default ``fp8,fp4`` gives SNIP's
eight. The option name lists the three formats, ``x=<fmt>,w=<fmt>,dy=<fmt>``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from megatron_ext.formats import get_format
from megatron_ext.precision.cost import operand_class
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.sites import ROLES
from megatron_ext.precision.site_formats import PASSTHROUGH, SiteFormats

DEFAULT_CANDIDATES = "fp8,fp4"
"""SNIP's candidate set: FP8 and FP4 per role."""


@dataclass(frozen=True)
class Candidates:
    """The formats each role may take, in the order given on the command line."""

    per_role: dict[str, tuple[str, ...]]
    """Role (``x``, ``w``, ``dy``) -> candidate format names."""

    def formats(self, role: str) -> tuple[str, ...]:
        return self.per_role[role]

    def all_formats(self) -> dict[str, tuple[str, ...]]:
        return dict(self.per_role)

    def options(self) -> list[SiteFormats]:
        """Every combination of one candidate per role (x varies slowest)."""
        return [SiteFormats(x, w, dy) for x, w, dy in
                itertools.product(*(self.per_role[r] for r in ROLES))]


def parse_candidates(spec: str) -> Candidates:
    """``"fp8,fp4"`` / ``"fp8_e4m3@tile128,fp4_e2m1@tile128"`` -> :class:`Candidates`;
    ``ValueError`` for an unknown name, a duplicate, or fewer than two candidates."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(f"need at least two distinct candidates, got {spec!r}")
    per_role: dict[str, list[str]] = {r: [] for r in ROLES}
    for name in names:
        if name == PASSTHROUGH:  # the run's own precision, unquantized
            for role in ROLES:
                per_role[role].append(PASSTHROUGH)
            continue
        if name in UNIFORM:
            recipe = UNIFORM[name]
            for role in ROLES:
                per_role[role].append(getattr(recipe, role))
            continue
        get_format(name)  # ValueError names the unknown format
        for role in ROLES:
            per_role[role].append(name)
    return Candidates({r: tuple(f) for r, f in per_role.items()})


def option_name(formats: SiteFormats) -> str:
    """``x=<fmt>,w=<fmt>,dy=<fmt>``."""
    return ",".join(f"{role}={getattr(formats, role)}" for role in ROLES)


def parse_option_name(name: str) -> SiteFormats:
    """Inverse of :func:`option_name`."""
    parts = dict(p.split("=", 1) for p in name.split(","))
    return SiteFormats(parts["x"], parts["w"], parts["dy"])


def fp4_roles(formats: SiteFormats) -> int:
    """How many of the three roles run at FP4 rate (for ordering and plots)."""
    return sum(operand_class(getattr(formats, r)) == "fp4" for r in ROLES)
