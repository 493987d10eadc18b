"""PGQ stage ii: a recipe from a profile — which GEMMs to quantize, and why (PGQ §II-C, §II-D).

For every GEMM of every linear site, in this order:

1. **Roofline.** A faster format only pays off where arithmetic sets the time: a GEMM whose
   arithmetic intensity (profile metadata) is below the device's ridge point stays high
   precision (:data:`megatron_ext.precision.cost.DEVICES`; ``--pgq-device none``: no filter).
   The GEMMs that pass are the **eligible** ones.
2. **SQNR threshold.** An eligible GEMM is quantized iff the lower SQNR of its two operands,
   in the recipe's candidate format (``--pgq-format``), reaches the threshold of its
   direction: ``--pgq-fwd-threshold`` for fprop, ``--pgq-bwd-threshold`` for dgrad and
   wgrad (the paper's 20:1 and 1:1). Its **margin** is that SQNR over its threshold; the rule
   is margin >= 1.
3. **Budget** (``--pgq-budget F``). Both thresholds are multiplied by one factor ``s``
   (keeping their ratio): the largest ``s`` whose recipe quantizes at least ``F`` of the
   linear-layer FLOPs. The quantized fraction grows as ``s`` falls and changes only where
   ``s`` crosses a margin, so the bisection runs over the sorted distinct margins and is
   exact. With an FP4 candidate the quantized fraction is SNIP's FP4 fraction, so PGQ and
   SNIP compare at equal ``F``. When every eligible GEMM together falls short, all of them
   are quantized and the recipe says so.

**Validation recipes** (§II-D), among the same eligible GEMMs, at the recipe's quantized
FLOPs — the prefix of an order whose FLOPs come closest (ties: the shorter one):

* ``adversarial`` — the order reversed: lowest margin first;
* ``random`` — a seeded random order (the training seed's draw ``--pgq-random-draw``, or
  ``--pgq-seed``'s: :mod:`megatron_ext.precision.random_draw`).

**Direction-stratified** (``--pgq-forward all|none``, the paper's §II-D validation: its
adversarial recipe keeps every forward op quantized and reverses only the backward
decision). Every eligible forward GEMM is then quantized (``all``) or kept (``none``) in
*every* mode, and the thresholds, the budget bisection and the validation orders act on the
backward GEMMs only; the budget still counts all FLOPs (the forward share included), so the
three modes differ only in *which* backward GEMMs they quantize, at matched FLOPs.
``threshold`` (the default) treats both directions alike, as above.

**The logits GEMM** (``--pgq-logits``): its three GEMMs join the eligible ones (margins from
their own SQNRs — ``logits.dgrad``'s ``dy`` is the paper's decisive operand — FLOPs
``2·tokens·V·H`` each, counted in the total the budget and fractions refer to); the recipe
then carries the output layer's formats (``logits``), which training installs on megatron's
output layer (:func:`megatron_ext.methods.pgq.logits.quantize_logits`).

**The plan.** A quantized GEMM reads both operands in the candidate's role formats; every
other operand passes through (``none``: the run's own precision). A role gets the candidate's
format where both GEMMs reading it are quantized and ``none`` where neither is; a role read
by one quantized GEMM only becomes a per-GEMM override (``"wgrad.x": "int8@row"``). The
embedding and logits GEMMs are reported, with what the threshold would say, never quantized.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from megatron_ext.methods.pgq.profile import EMBEDDING, LOGITS, GemmProfile, Profile
from megatron_ext.precision.cost import DEVICES, Device, flop_report, site_cost
from megatron_ext.precision.device_profile import DeviceProfile
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.site_formats import PASSTHROUGH, SiteFormats
from megatron_ext.sites import GEMM_ROLES, ROLES, parse_site_id

MODES = ("recipe", "adversarial", "random")
"""``recipe``: the SQNR thresholds; the two validation recipes of the module docstring."""
FORWARD = ("threshold", "all", "none")
"""``--pgq-forward``: forward GEMMs decided like backward ones, or all quantized / all kept
(direction-stratified: the modes choose among backward GEMMs only)."""
NO_ROOFLINE = "none"
"""``--pgq-device none``: every GEMM is eligible."""


@dataclass(frozen=True)
class RecipeConfig:
    """How a recipe is made from a profile (the ``--pgq-*`` recipe flags)."""

    format: str = "int8"
    """Candidate the quantized GEMMs use (a profile candidate name)."""
    fwd_threshold: float = 20.0
    """Minimum SQNR ratio of a forward (fprop) GEMM's operands."""
    bwd_threshold: float = 1.0
    """Minimum SQNR ratio of a backward (dgrad, wgrad) GEMM's operands."""
    device: str = "h100"
    """Roofline preset (a :data:`DEVICES` name) or ``none``."""
    budget: float | None = None
    """Target quantized fraction of the linear FLOPs (None: the thresholds as given)."""
    mode: str = "recipe"
    """One of :data:`MODES`."""
    seed: int = 0
    """Seed of the random recipe (``precision.random_draw.draw_seed`` of the training seed,
    ``--pgq-seed`` and ``--pgq-random-draw``)."""
    forward: str = "threshold"
    """One of :data:`FORWARD`."""
    logits: bool = False
    """The logits GEMMs are quantizable (else reported only)."""

    def threshold(self, direction: str) -> float:
        return self.fwd_threshold if direction == "forward" else self.bwd_threshold


@dataclass(frozen=True)
class Decision:
    """One GEMM's row in the explanation table."""

    name: str
    """``<site>.<gemm>``."""
    linear: bool
    """A linear site's GEMM (else the embedding or logits GEMM)."""
    direction: str
    """``forward`` or ``backward``."""
    min_sqnr: float
    """Lower SQNR of its operands in the recipe format."""
    worst: str
    """The role with that SQNR."""
    threshold: float
    """The threshold it was held to (after the budget's scaling)."""
    intensity: float
    """FLOP/byte of the GEMM one rank runs."""
    eligible: bool
    """Linear and above the ridge point."""
    quantized: bool
    """In the plan's quantized GEMMs."""
    reason: str
    """Why, in words."""


@dataclass(frozen=True)
class Recipe:
    """A recipe, its plan and its explanation."""

    config: RecipeConfig
    """What it was made with."""
    device: Device | None
    """The roofline (None: no filter)."""
    scale: float
    """Factor on both thresholds (1 without a budget; ``inf``: nothing quantized)."""
    decisions: tuple[Decision, ...]
    """Every GEMM of the profile, in profile order."""
    plan: PrecisionPlan
    """The quantized GEMMs as per-site formats."""
    fraction: float
    """Quantized fraction of the linear-layer FLOPs (the cost model's; with ``--pgq-logits``
    of the linear plus logits FLOPs)."""
    target: float | None
    """The fraction aimed at: the budget, or (validation recipes) the SQNR recipe's."""
    time_vs_bf16: float
    """Estimated linear-GEMM time relative to all-BF16 (the cost model's)."""
    logits: SiteFormats | None = None
    """The output layer's formats (``--pgq-logits`` with a logits GEMM quantized), else None."""


def sqnr_text(ratio: float) -> str:
    """``412 (26.1 dB)``; ``inf (exact)``."""
    if ratio == math.inf:
        return "inf (exact)"
    return f"{ratio:.3g} ({10 * math.log10(ratio):.1f} dB)" if ratio > 0 else "0 (-inf dB)"


def _bisect(eligible: list[GemmProfile], margin: dict, flops: dict, total: float,
            budget: float) -> tuple[float, set[str]]:
    """The largest threshold factor quantizing >= ``budget`` of ``total`` (module docstring)."""
    levels = sorted({margin[g.name] for g in eligible}, reverse=True)

    def taken(k: int) -> set[str]:
        return {g.name for g in eligible if k and margin[g.name] >= levels[k - 1]}

    def fraction(k: int) -> float:
        return sum(flops[n] for n in taken(k)) / total

    lo, hi = 0, len(levels)
    if fraction(hi) >= budget:
        while lo < hi:  # fraction(k) is non-decreasing in k: find the smallest k reaching it
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fraction(mid) >= budget else (mid + 1, hi)
    return (levels[hi - 1] if hi else math.inf), taken(hi)


def _closest_prefix(order: list[str], flops: dict, target: float) -> set[str]:
    """The prefix of ``order`` whose FLOPs are closest to ``target`` (ties: the shorter)."""
    best, best_k, cumulative = abs(target), 0, 0.0
    for k, name in enumerate(order, 1):
        cumulative += flops[name]
        if abs(cumulative - target) < best * (1 - 1e-12):
            best, best_k = abs(cumulative - target), k
    return set(order[:best_k])


def _quantizable(g: GemmProfile, cfg: RecipeConfig) -> bool:
    """A GEMM a plan (or, with ``--pgq-logits``, the output layer) can quantize."""
    return g.linear or (cfg.logits and g.site == LOGITS)


def gemm_flops(profile: Profile, cfg: RecipeConfig) -> dict[str, float]:
    """FLOPs per step of every quantizable GEMM: the cost model's for linear sites, the
    profile's ``2·tokens·V·H`` for the logits GEMMs."""
    shape = profile.shape()
    return {g.name: (site_cost(shape, parse_site_id(g.site)[1], SiteFormats()).gemm_flops
                     if g.linear else g.flops)
            for g in profile.gemms if _quantizable(g, cfg)}


def choose(profile: Profile, cfg: RecipeConfig) -> tuple[set[str], float, set[str], float]:
    """(quantized GEMM names, threshold factor, eligible names, target fraction) of ``cfg``;
    the target is the budget, or for a validation recipe the SQNR recipe's fraction."""
    device = None if cfg.device == NO_ROOFLINE else DEVICES[cfg.device]
    flops = gemm_flops(profile, cfg)
    pool = [g for g in profile.gemms if g.name in flops]
    margin = {g.name: g.min_sqnr(cfg.format)[0] / cfg.threshold(g.direction) for g in pool}
    total = sum(flops.values())
    eligible = [g for g in pool if device is None or g.intensity >= device.ridge]
    names = {g.name for g in eligible}
    fixed = set()
    if cfg.forward != "threshold":  # stratified: forward fixed, the modes choose backward
        forward = {g.name for g in eligible if g.direction == "forward"}
        fixed = forward if cfg.forward == "all" else set()
        eligible = [g for g in eligible if g.name not in forward]
    if cfg.budget is None:
        scale, chosen = 1.0, {g.name for g in eligible if margin[g.name] >= 1}
    else:
        rest = cfg.budget - sum(flops[n] for n in fixed) / total
        scale, chosen = _bisect(eligible, margin, flops, total, rest)
    if cfg.mode == "recipe":
        return chosen | fixed, scale, names, cfg.budget
    target = sum(flops[n] for n in chosen)
    order = sorted((g.name for g in eligible), key=lambda n: (margin[n], n))
    if cfg.mode == "random":
        random.Random(cfg.seed).shuffle(order)
    picked = _closest_prefix(order, flops, target) | fixed
    return picked, scale, names, sum(flops[n] for n in chosen | fixed) / total


def plan_of(quantized: set[str], candidate: SiteFormats, sites: list[str], method: str,
            step: int, budget: float | None) -> PrecisionPlan:
    """The PrecisionPlan running exactly the ``quantized`` GEMMs in ``candidate``."""
    out = {site: site_formats(quantized, candidate, site) for site in sites}
    return PrecisionPlan({s: f for s, f in out.items() if f is not None}, method=method,
                         step=step, budget=budget)


def site_formats(quantized: set[str], candidate: SiteFormats, site: str) -> SiteFormats | None:
    """The formats running exactly ``site``'s GEMMs in ``quantized`` in ``candidate`` (the
    rest passthrough); None if none of them is."""
    on = {g for g in GEMM_ROLES if f"{site}.{g}" in quantized}
    if not on:
        return None
    roles, overrides = {}, []
    for role in ROLES:
        readers = [g for g, rs in GEMM_ROLES.items() if role in rs]
        both = all(g in on for g in readers)
        roles[role] = getattr(candidate, role) if both else PASSTHROUGH
        if not both:
            overrides += [(f"{g}.{role}", candidate.operand(g, role))
                          for g in readers if g in on]
    return SiteFormats(**roles, overrides=tuple(overrides))


def _reason(g: GemmProfile, cfg: RecipeConfig, device, eligible: bool, quantized: bool,
            sqnr: float, worst: str, threshold: float) -> str:
    passes = sqnr >= threshold
    test = f"min SQNR {sqnr_text(sqnr)} of {worst} {'>=' if passes else '<'} {threshold:.3g}"
    if not _quantizable(g, cfg):
        what = "embedding lookup" if g.site == EMBEDDING else "output layer"
        return f"reported only ({what}: not in a plan); {test}"
    if not eligible:
        return f"memory-bound: intensity {g.intensity:.0f} < ridge {device.ridge:.0f} FLOP/B"
    if cfg.forward != "threshold" and g.direction == "forward":
        return f"forward {'quantized' if quantized else 'kept'} (--pgq-forward {cfg.forward})"
    if cfg.mode == "recipe":
        return ("quantized: " if quantized else "kept: ") + test
    how = "lowest margins first" if cfg.mode == "adversarial" else f"seed {cfg.seed}"
    return f"{cfg.mode} ({how}): {'quantized' if quantized else 'kept'}; {test}"


def make_recipe(profile: Profile, cfg: RecipeConfig,
                device_profile: DeviceProfile | None = None) -> Recipe:
    """The recipe ``cfg`` makes of ``profile``, its estimated GEMM time on ``device_profile``
    (default ``nominal``); ``ValueError`` for a format it lacks."""
    if cfg.format not in profile.candidates:
        raise ValueError(f"format {cfg.format!r} was not profiled (the profile has "
                         f"{', '.join(profile.candidates)})")
    device = None if cfg.device == NO_ROOFLINE else DEVICES[cfg.device]
    quantized, scale, eligible, target = choose(profile, cfg)
    decisions = []
    for g in profile.gemms:
        sqnr, worst = g.min_sqnr(cfg.format)
        threshold = cfg.threshold(g.direction) * scale
        decisions.append(Decision(
            g.name, g.linear, g.direction, sqnr, worst, threshold, g.intensity, g.name in eligible,
            g.name in quantized,
            _reason(g, cfg, device, g.name in eligible, g.name in quantized, sqnr, worst,
                    threshold)))
    sites = list(dict.fromkeys(g.site for g in profile.gemms if g.linear))
    method = "pgq" if cfg.mode == "recipe" else f"pgq:{cfg.mode}"
    candidate = SiteFormats.from_dict(profile.candidates[cfg.format])
    plan = plan_of(quantized, candidate, sites, method, profile.step, cfg.budget)
    report = flop_report(plan.formats, profile.shape(), profile=device_profile)
    fraction = 1 - report.fractions["bf16"]
    if cfg.logits:  # the linear fraction re-weighted by the linear + logits FLOPs
        flops = gemm_flops(profile, cfg)
        head = {n: f for n, f in flops.items() if n.startswith(f"{LOGITS}.")}
        linear = sum(flops.values()) - sum(head.values())
        fraction = ((fraction * linear + sum(f for n, f in head.items() if n in quantized))
                    / (linear + sum(head.values())))
    return Recipe(cfg, device, scale, tuple(decisions), plan, fraction, target,
                  report.time_vs_bf16, site_formats(quantized, candidate, LOGITS))
