"""A stable colour per number-format family, shared by every plot.

A format name's **family** is its element name's first word, without scaling and rounding
suffixes: ``fp8_e4m3@tile128`` and ``fp8_e5m2@block128+sr`` are ``fp8``, ``mxfp8_e5m2`` is
``mxfp8``, ``fp4_e2m1@tile128+sr`` is ``fp4``, ``nvfp4`` is ``nvfp4``, ``none`` (an operand passed
through untouched) is ``none``. Known families have fixed colours (greys and blues for 16 bits
and wider, greens for 8, oranges for 6, reds and purples for 4); any other name gets a colour
derived from its sha256, so the same family has the same colour in every plot and every run.
"""

from __future__ import annotations

import colorsys
import hashlib

FAMILY_COLORS = {
    "none": "#d9d9d9",
    "fp32": "#7f7f7f",
    "fp16": "#9ecae1",
    "bf16": "#4c72b0",
    "fp8": "#55a868",
    "mxfp8": "#1b7f5f",
    "int8": "#a6d854",
    "fp6": "#dd8452",
    "mxfp6": "#e6b13c",
    "fp4": "#c44e52",
    "mxfp4": "#8172b3",
    "nvfp4": "#d45fb0",
    "int4": "#8c564b",
}
"""Fixed colours of the known families, widest first (also the legend order)."""

CLASS_COLORS = {"fp4": FAMILY_COLORS["fp4"], "fp8": FAMILY_COLORS["fp8"],
                "bf16": FAMILY_COLORS["bf16"]}
"""Colours of the cost model's precision classes (``megatron_ext.precision.cost.CLASSES``)."""


def format_family(name: str) -> str:
    """Family of a format name: ``"fp8_e4m3@tile128+sr"`` -> ``"fp8"``, ``"mxfp4"`` ->
    ``"mxfp4"``, ``"none"`` -> ``"none"``."""
    base = name.strip().lower().split("@")[0].split("+")[0]
    return base.split("_")[0] or "none"


def _hashed_color(family: str) -> str:
    """A mid-saturation colour picked by the family name's sha256 (stable across runs)."""
    digest = hashlib.sha256(family.encode()).digest()
    hue = int.from_bytes(digest[:2], "big") / 65535.0
    r, g, b = colorsys.hls_to_rgb(hue, 0.55, 0.55)
    return "#{:02x}{:02x}{:02x}".format(*(round(c * 255) for c in (r, g, b)))


def family_color(family: str) -> str:
    """Hex colour of a format family."""
    return FAMILY_COLORS.get(family) or _hashed_color(family)


def format_color(name: str) -> str:
    """Hex colour of a format name (its family's)."""
    return family_color(format_family(name))


def legend_order(families) -> list[str]:
    """Families in legend order: known ones widest first, then the others by name."""
    known = [f for f in FAMILY_COLORS if f in families]
    return known + sorted(set(families) - set(known))
