"""Format = element type + scaling + rounding, and the name grammar that builds one.

Grammar (case-insensitive, surrounding blanks ignored)::

    name     := alias ["+sr"] | element ["@" scaling] ["+sr"]
    element  := fp32 | bf16 | fp16 | fp8_e4m3 | fp8_e5m2 | fp6_e3m2 | fp6_e2m3
              | fp4_e2m1 | int8 | int4
    scaling  := none | tensor | row | col | tile<N> | block<N> | mx[<N>] | nv[<N>]
    alias    := mxfp8 | mxfp8_e5m2 | mxfp6_e3m2 | mxfp6_e2m3 | mxfp4 | nvfp4

Without ``@``, IEEE casts (fp32/bf16/fp16) are unscaled and everything else is scaled per
tensor. ``+sr`` selects stochastic rounding. A format's ``str()`` is its name, so formats
travel through command-line flags and JSON as plain strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .elements import ElementType, get_element
from .rounding import Rounding
from .scaling import AmaxScaling, ColScaling, MXScaling, NoScaling, NVScaling, Scaling

__all__ = ["Format", "available", "get_format", "parse_format", "register"]

SR_SUFFIX = "+sr"

_ALIASES = {
    "mxfp8": "fp8_e4m3@mx32",
    "mxfp8_e5m2": "fp8_e5m2@mx32",
    "mxfp6_e3m2": "fp6_e3m2@mx32",
    "mxfp6_e2m3": "fp6_e2m3@mx32",
    "mxfp4": "fp4_e2m1@mx32",
    "nvfp4": "fp4_e2m1@nv16",
}

_SCALING_PATTERNS = [
    (re.compile(r"none"), lambda n: NoScaling()),
    (re.compile(r"tensor"), lambda n: AmaxScaling(rows=None, cols=None)),
    (re.compile(r"row"), lambda n: AmaxScaling(rows=1, cols=None)),
    (re.compile(r"col"), lambda n: ColScaling(rows=1, cols=None)),
    (re.compile(r"tile(\d+)"), lambda n: AmaxScaling(rows=1, cols=n)),
    (re.compile(r"block(\d+)"), lambda n: AmaxScaling(rows=n, cols=n)),
    (re.compile(r"mx(\d*)"), lambda n: MXScaling(cols=n or 32)),
    (re.compile(r"nv(\d*)"), lambda n: NVScaling(cols=n or 16)),
]


@dataclass(frozen=True)
class Format:
    """A low-precision number format. Two formats are equal when they quantize the same
    way, whatever they are called (``mxfp4 == fp4_e2m1@mx32``)."""

    element: ElementType
    """The grid each value is rounded onto (:mod:`.elements`)."""
    scaling: Scaling
    """How blocks of values are mapped onto the element range (:mod:`.scaling`)."""
    rounding: Rounding = Rounding.NEAREST
    """Nearest-even or stochastic (:mod:`.rounding`)."""
    name: str = field(default="", compare=False)
    """The name it was looked up by (normalised); :attr:`canonical` if built directly."""

    def __post_init__(self):
        self.scaling.check(self.element)
        if self.stochastic and not self.element.supports_stochastic:
            raise ValueError(f"{self.element.name} has no stochastic rounding (+sr)")
        if not self.name:
            object.__setattr__(self, "name", self.canonical)

    @property
    def bits(self) -> int:
        """Storage bits of one element (4, 6, 8, 16, 32), scales not counted."""
        return self.element.bits

    @property
    def stochastic(self) -> bool:
        """Whether rounding is stochastic (needs random numbers; see ``generator``)."""
        return self.rounding == Rounding.STOCHASTIC

    @property
    def effective_bits(self) -> float:
        """Bits per element including the block scale (mxfp4: 4.25, nvfp4: 4.5)."""
        rows, cols = self.scaling.rows, self.scaling.cols
        if not self.scaling.scale_bits or rows is None or cols is None:
            return float(self.bits)
        return self.bits + self.scaling.scale_bits / (rows * cols)

    @property
    def canonical(self) -> str:
        """The explicit ``<element>@<scaling>[+sr]`` spelling."""
        suffix = SR_SUFFIX if self.stochastic else ""
        return f"{self.element.name}@{self.scaling.name}{suffix}"

    def __str__(self) -> str:
        return self.name


def _parse_scaling(text: str) -> Scaling:
    for pattern, make in _SCALING_PATTERNS:
        match = pattern.fullmatch(text)
        digits = match.group(1) if match and pattern.groups else ""
        if match and (not digits or int(digits) > 0):
            return make(int(digits) if digits else None)
    raise ValueError(
        f"unknown scaling {text!r}; use none, tensor, row, col, tile<N>, block<N>, mx[<N>] "
        "or nv[<N>]"
    )


_REGISTERED: dict[str, str] = {}


def parse_format(name: str) -> Format:
    """Build the :class:`Format` a name describes (any ``<element>@<scaling>[+sr]`` combo).

    Raises ``ValueError`` naming the problem and listing :func:`available` names.
    """
    if not isinstance(name, str):
        raise TypeError(f"a format name must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    try:
        spec = _REGISTERED.get(key, key)
        stochastic = spec.endswith(SR_SUFFIX)
        base = spec[: -len(SR_SUFFIX)] if stochastic else spec
        base = _ALIASES.get(base, base)
        element_name, at, scaling_name = base.partition("@")
        element = get_element(element_name)
        if not at:
            scaling_name = "tensor" if element.supports_scaling else "none"
        scaling = _parse_scaling(scaling_name)
        rounding = Rounding.STOCHASTIC if stochastic else Rounding.NEAREST
        return Format(element=element, scaling=scaling, rounding=rounding, name=key)
    except ValueError as err:
        raise ValueError(
            f"bad format name {name!r}: {err}. Available: {', '.join(available())}"
        ) from None


def get_format(fmt: str | Format) -> Format:
    """The :class:`Format` for a name (or the format itself)."""
    return fmt if isinstance(fmt, Format) else parse_format(fmt)


def register(name: str, spec: str) -> Format:
    """Register ``name`` as a spelling of format ``spec`` and list it in :func:`available`.

    Registering a name again for the same format is a no-op; for another, a ``ValueError``.
    """
    key = name.strip().lower()
    target = _REGISTERED.get(spec.strip().lower(), spec.strip().lower())
    fmt = parse_format(target)  # validate before registering
    if key in _REGISTERED and parse_format(key) != fmt:
        raise ValueError(f"format name {name!r} is already registered as {_REGISTERED[key]!r}")
    _REGISTERED[key] = target
    return parse_format(key)


_STANDARD = [
    "fp32", "bf16", "fp16",
    "fp8_e4m3", "fp8_e5m2", "fp8_e4m3@row", "fp8_e5m2@row",
    "fp8_e4m3@tile128", "fp8_e4m3@block128", "fp8_e5m2@tile128", "fp8_e5m2@block128",
    "fp6_e3m2@tile128", "fp6_e2m3@tile128",
    "fp4_e2m1@tile128", "fp4_e2m1@block128",
    "mxfp8", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4",
    "int8", "int8@row", "int8@tile128", "int8@block128", "int4@row", "int4@tile128", "int4@block128",
]  # fmt: skip

for _name in _STANDARD:
    _REGISTERED[_name] = _name
    if get_element(_ALIASES.get(_name, _name).partition("@")[0]).supports_stochastic:
        _REGISTERED[_name + SR_SUFFIX] = _name + SR_SUFFIX


def available() -> list[str]:
    """Registered format names (the standard set, their ``+sr`` variants, and any added
    with :func:`register`). Other ``<element>@<scaling>`` combos parse too."""
    return list(_REGISTERED)
