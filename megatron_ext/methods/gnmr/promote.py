"""What a promoted site runs in: its base formats lifted, operand by operand, never lowered.

``--gnmr-high`` picks the lift:

* ``auto`` (default): one precision class up, per operand — an FP4-class operand (at most 4
  bits: E2M1, INT4, MXFP4, NVFP4) becomes FP8 in DeepSeek-V3's layout (``fp8_e4m3@tile128``
  for ``x`` and ``dy``, ``fp8_e4m3@block128`` for ``w``, as ``--precision uniform:fp8``) —
  except a per-token one (``@col``, ``uniform:wgrad-x4-token``), which stays per token in
  E4M3 (``fp8_e4m3@col``: GNMR §5.1's 4 -> 8 bits) —, an FP8-class one (5 to 8 bits: E4M3,
  E5M2, the FP6 formats, INT8) becomes ``bf16``; BF16, wider formats and passthrough stay.
* ``fp8`` / ``bf16``: every operand narrower than that recipe's format for its role
  (:data:`megatron_ext.precision.policies.UNIFORM`) takes it; the others stay.

Per-GEMM overrides (``"wgrad.x": ...``) are lifted by the same rule, by their role. "Narrower"
compares element bits (``megatron_ext.formats.get_format(name).bits``); passthrough counts as
wider than everything. So a promotion never lowers an operand, and a site the base plan
already holds high is returned unchanged. ``auto`` is one step of lifting, meant to be applied
to the *base* plan's formats (applied twice it lifts FP4 to BF16).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from megatron_ext.formats import get_format
from megatron_ext.formats.scaling import ColScaling
from megatron_ext.methods.gnmr.decisions import HIGH_CHOICES
from megatron_ext.methods.gnmr.units import unit_sites
from megatron_ext.precision.cost import operand_class
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import PASSTHROUGH, SiteFormats
from megatron_ext.sites import ROLES

_AUTO_UP = {"fp4": "fp8", "fp8": "bf16"}
"""``auto``: the recipe an operand of each class is lifted to."""
TOKEN_FP8 = "fp8_e4m3@col"
"""``auto``'s lift of a per-token FP4-class operand."""


def _bits(name: str) -> float:
    return float("inf") if name == PASSTHROUGH else get_format(name).bits


def lift_operand(name: str, role: str, high: str) -> str:
    """The format a promoted ``role`` operand of format ``name`` runs in."""
    if high == "auto":
        recipe = _AUTO_UP.get(operand_class(name))
        if recipe == "fp8" and isinstance(get_format(name).scaling, ColScaling):
            return TOKEN_FP8
        return name if recipe is None else getattr(UNIFORM[recipe], role)
    if high not in HIGH_CHOICES:
        raise ValueError(f"--gnmr-high must be one of {HIGH_CHOICES}, got {high!r}")
    target = getattr(UNIFORM[high], role)
    return target if _bits(target) > _bits(name) else name


def promoted_formats(formats: SiteFormats, high: str) -> SiteFormats:
    """``formats`` with every operand (and override) lifted by ``high``."""
    roles = {role: lift_operand(getattr(formats, role), role, high) for role in ROLES}
    overrides = tuple((op, lift_operand(fmt, op.split(".")[1], high))
                      for op, fmt in formats.overrides)
    return SiteFormats(**roles, overrides=overrides)


def promotion_overlay(base: Mapping[str, SiteFormats], units: Iterable[str],
                      high: str) -> dict[str, SiteFormats]:
    """The sites of ``units`` whose formats change when promoted, with their new formats
    (the overlay GNMR lays over the base plan ``base``: site id -> formats)."""
    overlay = {}
    for unit in units:
        for sid in unit_sites(unit):
            if sid in base:
                lifted = promoted_formats(base[sid], high)
                if lifted != base[sid]:
                    overlay[sid] = lifted
    return overlay
