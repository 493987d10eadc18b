"""The formats a site's GEMM operands use (sites and roles: :mod:`megatron_ext.sites`).

:class:`SiteFormats` gives each role one format name (a ``megatron_ext.formats`` name, or
``"none"``: pass the operand through untouched), used by both GEMMs that read the role, plus
optional per-GEMM **overrides** keyed ``"<gemm>.<role>"`` (``"wgrad.x": "bf16"``) for methods
that pick formats per GEMM operand (PGQ). :func:`resolve` turns it into the six operand
formats the autograd function reads (:class:`GemmOperands`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import lru_cache

from megatron_ext.formats import Format, get_format
from megatron_ext.sites import OPERANDS, ROLES

PASSTHROUGH = "none"
"""Format name meaning "no quantization": the operand enters the GEMM as it is."""


def normalize_format(name: str) -> str:
    """The registry's spelling of a format name (``"none"`` stays); ``ValueError`` if unknown."""
    if not isinstance(name, str):
        raise ValueError(f"a format must be a name string, got {name!r}")
    if name.strip().lower() == PASSTHROUGH:
        return PASSTHROUGH
    try:
        return str(get_format(name))
    except ValueError:
        raise ValueError(f"unknown format {name!r} (see "
                         "megatron_ext.formats.available())") from None


@dataclass(frozen=True)
class SiteFormats:
    """The formats of one site's GEMM operands (names are normalized on construction)."""

    x: str = PASSTHROUGH
    """Format of the input activation in fprop and wgrad."""
    w: str = PASSTHROUGH
    """Format of the weight in fprop and dgrad."""
    dy: str = PASSTHROUGH
    """Format of the output gradient in dgrad and wgrad."""
    overrides: tuple[tuple[str, str], ...] = field(default=())
    """Sorted ``(operand, format)`` pairs, operand in :data:`OPERANDS`, that replace the role's
    format in that one GEMM (``("wgrad.x", "bf16")``)."""

    def __post_init__(self):
        for role in ROLES:
            object.__setattr__(self, role, normalize_format(getattr(self, role)))
        pairs = dict(self.overrides)
        unknown = sorted(set(pairs) - set(OPERANDS))
        if unknown or len(pairs) != len(self.overrides):
            raise ValueError(f"bad override operand(s) {unknown or 'repeated'}; "
                             f"use {', '.join(OPERANDS)}")
        normalized = tuple(sorted((k, normalize_format(v)) for k, v in pairs.items()))
        object.__setattr__(self, "overrides", normalized)

    def operand(self, gemm: str, role: str) -> str:
        """The format ``gemm`` reads ``role`` in: its override, else the role's format."""
        return dict(self.overrides).get(f"{gemm}.{role}", getattr(self, role))

    def to_dict(self) -> dict:
        out = {role: getattr(self, role) for role in ROLES}
        if self.overrides:
            out["overrides"] = dict(self.overrides)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "SiteFormats":
        """Inverse of :meth:`to_dict`: ``x``, ``w``, ``dy`` required, ``overrides`` optional."""
        if not isinstance(data, dict):
            raise ValueError(f"expected an object with keys {', '.join(ROLES)}, got {data!r}")
        missing = [role for role in ROLES if role not in data]
        extra = sorted(set(data) - {*ROLES, "overrides"})
        if missing or extra:
            raise ValueError(f"needs keys {', '.join(ROLES)} (+ optional overrides); "
                             f"missing {missing}, unknown {extra}")
        overrides = data.get("overrides", {})
        if not isinstance(overrides, dict):
            raise ValueError(f"overrides must be an object, got {overrides!r}")
        return cls(*(data[role] for role in ROLES), overrides=tuple(overrides.items()))


@dataclass(frozen=True)
class GemmOperands:
    """The resolved format of each GEMM operand of a site; ``None`` = passthrough."""

    fprop_x: Format | None
    """x in ``y = x @ w.T``, blocks along K (the hidden dim of x)."""
    fprop_w: Format | None
    """w in ``y = x @ w.T``, blocks along K (dim 1 of w)."""
    dgrad_dy: Format | None
    """dy in ``dx = dy @ w``, blocks along N (the output dim)."""
    dgrad_w: Format | None
    """w in ``dx = dy @ w``, blocks along N (dim 0 of w)."""
    wgrad_dy: Format | None
    """dy in ``dw = dy.T @ x``, blocks along the token dim T."""
    wgrad_x: Format | None
    """x in ``dw = dy.T @ x``, blocks along the token dim T."""

    @property
    def passthrough(self) -> bool:
        """No operand is quantized: the site is plain megatron."""
        return all(getattr(self, f.name) is None for f in fields(self))

    @property
    def dgrad_reuses_fprop_w(self) -> bool:
        """dgrad's w equals fprop's w transposed (:func:`same_either_way`) — 128x128 weights."""
        return self.dgrad_w == self.fprop_w and same_either_way(self.fprop_w)

    @property
    def wgrad_reuses_fprop_x(self) -> bool:
        """wgrad's x (along T) equals fprop's q(x) (along K): per-tensor or square-block x."""
        return self.wgrad_x == self.fprop_x and same_either_way(self.fprop_x)

    @property
    def wgrad_reuses_dgrad_dy(self) -> bool:
        """wgrad's dy (along T) equals dgrad's q(dy) (along N): per-tensor or square-block dy."""
        return self.wgrad_dy == self.dgrad_dy and same_either_way(self.dgrad_dy)


def same_either_way(fmt: Format | None) -> bool:
    """Whether a tensor quantized in ``fmt`` along one axis equals it quantized along the
    other, bit for bit: deterministic rounding and blocks that do not care about the axis
    (one scale per tensor, square blocks, plain casts, passthrough). Then one quantization
    serves both GEMMs that read the operand, the second one transposed."""
    return fmt is None or (not fmt.stochastic and fmt.scaling.rows == fmt.scaling.cols)


@lru_cache(maxsize=None)
def resolve(formats: SiteFormats) -> GemmOperands:
    """The six operand formats of ``formats`` (cached: called on every GEMM)."""
    def fmt(gemm: str, role: str) -> Format | None:
        name = formats.operand(gemm, role)
        return None if name == PASSTHROUGH else get_format(name)

    return GemmOperands(*(fmt(*op.split(".")) for op in OPERANDS))
