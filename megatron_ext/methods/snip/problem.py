"""The SNIP precision-selection problem as plain data: sites, their options, pipeline stages.

This is the input of the ILP (:mod:`megatron_ext.methods.snip.ilp`) and of
``tools/snip_analyze.py``. It knows nothing about formats or models: a **site** (one linear
GEMM site, ``L{i}.{qkv|proj|fc1|fc2}`` in this project) sits on one pipeline **stage** and
offers **options** (say "all FP8", "FP4 for x and w", "all FP4"), each with

* ``q`` — its estimated quality loss (SNIP §5.1: loss + weight divergence, or any other
  estimate: the solver only minimises the sum),
* ``fp4_flops`` — the site's GEMM FLOPs that run in FP4 with that option,
* ``flops`` — all of the site's GEMM FLOPs (the same for every option of a site),
* ``time`` — the estimated seconds the site's GEMMs take with that option.

Every site must offer a zero-FP4 option: the safe plan the solver falls back to.

JSON form (``problem.json``; the in-training planner writes one per refresh)::

    {
      "version": 1,
      "num_stages": 2,
      "stage_fixed_time": [0.004, 0.009],        # optional, default all 0
      "meta": {"step": 5000},                    # optional, free-form, carried through
      "fp4_emulated": false,                     # optional: time mode asks for no FP4
      "sites": [
        {"site": "L0.qkv", "stage": 0, "options": [
          {"name": "fp8", "q": 0.001, "fp4_flops": 0, "flops": 6.0e12, "time": 0.0030},
          {"name": "fp4", "q": 0.020, "fp4_flops": 6.0e12, "flops": 6.0e12, "time": 0.0015}]},
        ...
      ]
    }

:func:`Problem.from_dict` turns malformed input into a one-line ``ValueError`` that names
the place (``sites[3] (L0.fc2) options[1]: missing key 'q'``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_ext.io import read_json, write_json_atomic

VERSION = 1

_OPTION_KEYS = {"name", "q", "fp4_flops", "flops", "time"}
_SITE_KEYS = {"site", "stage", "options"}
_PROBLEM_REQUIRED = {"num_stages", "sites"}
_PROBLEM_KEYS = _PROBLEM_REQUIRED | {"version", "stage_fixed_time", "meta", "fp4_emulated"}


@dataclass(frozen=True)
class Option:
    """One way to run a site."""

    name: str
    """Unique within its site (e.g. ``"fp8"``, ``"fp4:x+w"``)."""
    q: float
    """Estimated quality loss of this choice; the ILP minimises the sum over sites."""
    fp4_flops: float
    """GEMM FLOPs of the site that run in FP4 with this option (0 <= fp4_flops <= flops)."""
    flops: float
    """All GEMM FLOPs of the site (> 0, equal across the site's options)."""
    time: float = 0.0
    """Estimated seconds of the site's GEMMs with this option (>= 0; used by ``time`` mode)."""


@dataclass(frozen=True)
class Site:
    """One linear GEMM site and its options."""

    site: str
    """Site id, unique in the problem (``L3.fc1``)."""
    stage: int
    """Pipeline stage holding the site, ``0 <= stage < num_stages``."""
    options: tuple[Option, ...]
    """The choices; at least one, and at least one with ``fp4_flops == 0``."""

    @property
    def flops(self) -> float:
        """The site's GEMM FLOPs (the same for every option)."""
        return self.options[0].flops


@dataclass(frozen=True)
class Problem:
    """Sites grouped into pipeline stages; validated on construction."""

    sites: tuple[Site, ...]
    """All sites, in a stable order (the solver reports choices in this order)."""
    num_stages: int = 1
    """Pipeline stages ``K`` (PP size); every stage holds at least one site."""
    stage_fixed_time: tuple[float, ...] = ()
    """Seconds per stage that no option changes (attention core, embedding, output layer,
    loss); empty means all zero."""
    meta: dict = field(default_factory=dict, compare=False)
    """Free-form provenance (training step, model, how ``q`` was estimated); not read here."""
    fp4_emulated: bool = False
    """True when the device runs FP4 emulated: FP4 options are offered but none is faster than
    its site's fastest option without FP4; time mode then asks for no FP4 FLOPs (``E_t = 0``,
    :mod:`megatron_ext.methods.snip.ilp`)."""

    def __post_init__(self):
        k = self.num_stages
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"problem: num_stages must be a positive integer, got {k!r}")
        object.__setattr__(self, "sites", tuple(self.sites))
        fixed = tuple(float(t) for t in self.stage_fixed_time) or (0.0,) * k
        object.__setattr__(self, "stage_fixed_time", fixed)
        _check_problem(self)

    @property
    def total_flops(self) -> float:
        """Σ_i flops_i: the denominator of every FP4 fraction."""
        return math.fsum(s.flops for s in self.sites)

    def to_dict(self) -> dict:
        """The JSON form (module docstring)."""
        return {"version": VERSION, "num_stages": self.num_stages,
                "stage_fixed_time": list(self.stage_fixed_time), "meta": self.meta,
                "fp4_emulated": self.fp4_emulated,
                "sites": [{"site": s.site, "stage": s.stage,
                           "options": [vars(o).copy() for o in s.options]}
                          for s in self.sites]}

    @classmethod
    def from_dict(cls, data) -> Problem:
        """Build from the JSON form; ``ValueError`` (one line) for malformed input."""
        _keys(data, _PROBLEM_REQUIRED, _PROBLEM_KEYS, "problem")
        if data.get("version", VERSION) != VERSION:
            raise ValueError(f"problem: unsupported version {data['version']!r} "
                             f"(this reader knows {VERSION})")
        sites = data["sites"]
        if not isinstance(sites, list) or not sites:
            raise ValueError("problem: 'sites' must be a non-empty list")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError("problem: 'meta' must be an object")
        fixed = data.get("stage_fixed_time", [])
        if not isinstance(fixed, list):
            raise ValueError("problem: 'stage_fixed_time' must be a list of seconds per stage")
        return cls(tuple(_site_from_dict(s, i) for i, s in enumerate(sites)),
                   _integer(data["num_stages"], "problem: 'num_stages'"),
                   tuple(_number(t, f"problem: stage_fixed_time[{k}]")
                         for k, t in enumerate(fixed)), meta,
                   _flag(data.get("fp4_emulated", False), "problem: 'fp4_emulated'"))

    def save(self, path: str) -> None:
        """Write the JSON form atomically (temp file + rename)."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str) -> Problem:
        """Read and validate ``path``; ``ValueError`` for unreadable or malformed files."""
        data = read_json(path)
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


# ---------------------------------------------------------------- validation


def _keys(data, required: set, allowed: set, where: str) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    missing = sorted(required - data.keys())
    if missing:
        raise ValueError(f"{where}: missing key {missing[0]!r}")
    unknown = sorted(data.keys() - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (allowed: {sorted(allowed)})")


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _integer(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    return value


def _site_from_dict(data, index: int) -> Site:
    where = f"sites[{index}]"
    _keys(data, _SITE_KEYS, _SITE_KEYS, where)
    where += f" ({data['site']})"
    options = data["options"]
    if not isinstance(options, list) or not options:
        raise ValueError(f"{where}: 'options' must be a non-empty list")
    parsed = []
    for j, opt in enumerate(options):
        at = f"{where} options[{j}]"
        _keys(opt, _OPTION_KEYS - {"time"}, _OPTION_KEYS, at)
        parsed.append(Option(opt["name"], _number(opt["q"], f"{at} q"),
                             _number(opt["fp4_flops"], f"{at} fp4_flops"),
                             _number(opt["flops"], f"{at} flops"),
                             _number(opt.get("time", 0.0), f"{at} time")))
    return Site(data["site"], _integer(data["stage"], f"{where} stage"), tuple(parsed))


def _check_problem(problem: Problem) -> None:
    """Semantic checks shared by JSON input and direct construction."""
    k = problem.num_stages
    if len(problem.stage_fixed_time) != k:
        raise ValueError(f"problem: stage_fixed_time has {len(problem.stage_fixed_time)} "
                         f"entries for {k} stages")
    if any(t < 0 or not math.isfinite(t) for t in problem.stage_fixed_time):
        raise ValueError("problem: stage_fixed_time must be finite and >= 0")
    if not problem.sites:
        raise ValueError("problem: no sites")
    seen = set()
    for index, site in enumerate(problem.sites):
        _check_site(site, f"sites[{index}] ({site.site})", k)
        if site.site in seen:
            raise ValueError(f"sites[{index}]: duplicate site id {site.site!r}")
        seen.add(site.site)
    empty = sorted(set(range(k)) - {s.stage for s in problem.sites})
    if empty:
        raise ValueError(f"problem: stage {empty[0]} has no sites")


def _check_site(site: Site, where: str, num_stages: int) -> None:
    if not isinstance(site.site, str) or not site.site:
        raise ValueError(f"{where}: site id must be a non-empty string")
    if not 0 <= site.stage < num_stages:
        raise ValueError(f"{where}: stage {site.stage} out of range 0..{num_stages - 1}")
    if not site.options:
        raise ValueError(f"{where}: no options")
    names = [o.name for o in site.options]
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{where}: option names must be non-empty strings")
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: duplicate option name")
    for opt in site.options:
        at = f"{where} option {opt.name!r}"
        if not all(math.isfinite(v) for v in (opt.q, opt.fp4_flops, opt.flops, opt.time)):
            raise ValueError(f"{at}: q, fp4_flops, flops and time must be finite")
        if opt.flops <= 0:
            raise ValueError(f"{at}: flops must be > 0, got {opt.flops}")
        if not 0 <= opt.fp4_flops <= opt.flops:
            raise ValueError(f"{at}: fp4_flops must lie in [0, flops], got {opt.fp4_flops}")
        if opt.time < 0:
            raise ValueError(f"{at}: time must be >= 0, got {opt.time}")
        if not math.isclose(opt.flops, site.flops, rel_tol=1e-9):
            raise ValueError(f"{at}: flops {opt.flops} differs from the site's {site.flops}")
    if not any(o.fp4_flops == 0 for o in site.options):
        raise ValueError(f"{where}: no option with fp4_flops == 0 (the safe fallback)")


def _flag(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, got {value!r}")
    return value
