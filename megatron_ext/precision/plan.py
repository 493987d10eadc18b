"""PrecisionPlan: site -> formats, the one object every precision method produces.

JSON form (``version`` 1; sites in layer order, then qkv, proj, fc1, fc2)::

    {
      "version": 1,
      "method": "uniform:fp8",      # who made it
      "step": 0,                    # training step it was made at
      "budget": null,               # target FP4 FLOP fraction, if the method had one
      "objective": null,            # the method's objective value, if any
      "stage_fp4_frac": [1.0],      # achieved FP4 FLOP fraction per pipeline stage
      "sites": {
        "L0.qkv": {"x": "fp8_e4m3@tile128", "w": "fp8_e4m3@block128",
                   "dy": "fp8_e4m3@tile128", "overrides": {"wgrad.x": "bf16"}},
        ...
      }
    }

A site missing from ``sites`` runs unquantized (all ``"none"``). The **hash** is the sha256
of the canonical JSON (sorted keys, no spaces), so it names the plan's content: every rank
applies the plan and then compares hashes (``controller.verify_same_plan``). A value type:
this module imports neither torch.nn nor megatron-core (applying a plan to a model is
``layers.apply_plan``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace

from megatron_ext.io import read_json, write_text_atomic
from megatron_ext.sites import SITES, parse_site_id
from megatron_ext.precision.site_formats import SiteFormats

VERSION = 1
_META_KEYS = ("method", "step", "budget", "objective", "stage_fp4_frac")


def _site_order(sid: str) -> tuple[int, int]:
    layer, site = parse_site_id(sid)
    return layer, SITES.index(site)


@dataclass(frozen=True)
class PrecisionPlan:
    """Per-site operand formats plus how and when they were chosen."""

    sites: dict[str, SiteFormats]
    """Site id (``L{i}.{site}``) -> formats; absent sites are unquantized."""
    method: str = "manual"
    """The policy that made the plan (``uniform:fp8``, ``snip``, ...)."""
    step: int = 0
    """Training step the plan was made at."""
    budget: float | None = None
    """Target FP4 FLOP fraction the method was given, if any."""
    objective: float | None = None
    """The method's objective value for this plan (e.g. SNIP's quality loss), if any."""
    stage_fp4_frac: tuple[float, ...] = field(default=())
    """Achieved FP4 FLOP fraction of each pipeline stage."""

    def __post_init__(self):
        for sid in self.sites:
            parse_site_id(sid)
        ordered = dict(sorted(self.sites.items(), key=lambda item: _site_order(item[0])))
        object.__setattr__(self, "sites", ordered)
        object.__setattr__(self, "stage_fp4_frac", tuple(float(f) for f in self.stage_fp4_frac))

    def formats(self, sid: str) -> SiteFormats:
        """The formats of site ``sid`` (passthrough if the plan does not list it)."""
        return self.sites.get(sid, SiteFormats())

    def replace(self, **changes) -> "PrecisionPlan":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        meta = {key: getattr(self, key) for key in _META_KEYS}
        meta["stage_fp4_frac"] = list(self.stage_fp4_frac)
        return {"version": VERSION, **meta,
                "sites": {sid: f.to_dict() for sid, f in self.sites.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "PrecisionPlan":
        """Inverse of :meth:`to_dict`; ``ValueError`` naming the first problem."""
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} precision plan (need \"version\": 1)")
        extra = sorted(set(data) - {"version", "sites", *_META_KEYS})
        if extra:
            raise ValueError(f"unknown plan key(s) {extra}")
        sites = data.get("sites")
        if not isinstance(sites, dict):
            raise ValueError("\"sites\" must be an object: site id -> {x, w, dy}")
        parsed = {}
        for sid, formats in sites.items():
            parse_site_id(sid)
            try:
                parsed[sid] = SiteFormats.from_dict(formats)
            except ValueError as exc:
                raise ValueError(f"site {sid}: {exc}") from None
        meta = {key: data[key] for key in _META_KEYS if data.get(key) is not None}
        return cls(parsed, **meta)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "PrecisionPlan":
        return cls.from_dict(json.loads(text))

    @property
    def hash(self) -> str:
        """sha256 (hex) of the canonical JSON: same content, same hash, on any machine."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def check_model(self, num_layers: int) -> None:
        """``ValueError`` if a site lies outside a ``num_layers``-layer model."""
        for sid in self.sites:
            if parse_site_id(sid)[0] >= num_layers:
                raise ValueError(f"unknown site {sid}: the model has layers 0-{num_layers - 1}")


def load_plan(path: str) -> PrecisionPlan:
    """Read a plan file; ``ValueError`` (one line) for a missing file, bad JSON or bad plan."""
    data = read_json(path, expect=None)
    try:
        return PrecisionPlan.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"'{path}': {exc}") from None


def save_plan(plan: PrecisionPlan, path: str) -> None:
    """Write ``plan`` as JSON to ``path`` atomically (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text_atomic(path, plan.to_json() + "\n")
