"""The project's shared vocabulary of GEMM sites (one definition, used by every package).

A **site** is one linear layer of a transformer layer: megatron-core fuses Q/K/V and gate/up,
so a layer has four, ``qkv``, ``proj``, ``fc1``, ``fc2``. Its id carries the *global* 0-based
layer index, ``L{i}.{site}`` (e.g. ``L3.fc1``), the same on every TP / PP / DP rank.

A site runs three GEMMs, each reading two of its three **roles** — the input activation
``x``, the weight ``w`` and the output gradient ``dy``:

    fprop   y  = x  @ w.T     reads x, w
    dgrad   dx = dy @ w       reads dy, w
    wgrad   dw = dy.T @ x     reads dy, x
"""

from __future__ import annotations

import re

SITES = ("qkv", "proj", "fc1", "fc2")
"""The four linear sites of a transformer layer, in plan order."""

COLUMN_SITES = ("qkv", "fc1")
"""Sites megatron builds as ``ColumnParallelLinear`` (weight rows split over TP); the others
are ``RowParallelLinear`` (weight columns split)."""

ROLES = ("x", "w", "dy")
"""Operand roles: input activation, weight, output gradient."""

GEMM_ROLES = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("dy", "x")}
"""The two roles each GEMM of a site reads."""

OPERANDS = tuple(f"{gemm}.{role}" for gemm, roles in GEMM_ROLES.items() for role in roles)
"""The six GEMM operands (``"<gemm>.<role>"``), the keys of per-GEMM overrides."""

_SITE_ID = re.compile(r"L(0|[1-9]\d*)\.([a-z0-9]+)")


def site_id(layer: int, site: str) -> str:
    """``site_id(3, "fc1") == "L3.fc1"``."""
    return f"L{layer}.{site}"


def parse_site_id(text: str) -> tuple[int, str]:
    """``"L3.fc1"`` -> ``(3, "fc1")``; ``ValueError`` for anything else."""
    match = _SITE_ID.fullmatch(text) if isinstance(text, str) else None
    if match is None or match.group(2) not in SITES:
        raise ValueError(f"bad site id {text!r}: expected L<layer>.<{'|'.join(SITES)}>")
    return int(match.group(1)), match.group(2)


def all_site_ids(num_layers: int) -> list[str]:
    """Every site id of a ``num_layers``-layer model, in plan order."""
    return [site_id(layer, s) for layer in range(num_layers) for s in SITES]
