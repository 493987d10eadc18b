"""The plan controller: the plan in force = a base plan + ordered overlays, changed at step
boundaries only, identical on every rank.

Several methods may change a run's precision: a policy makes the **base plan** (a SNIP refresh
replaces it), and **overlays** change sites on top of it — ``--keep-first-last-layers-bf16``,
GNMR's promotions, a fallback after a non-finite step. Each overlay is owned by a named
extension and has a rule:

* ``set`` — its formats replace the site's;
* ``raise`` — each GEMM operand keeps the higher precision of the two (more effective bits;
  ``"none"``, no quantization, is highest), so an overlay never lowers a site the base
  already holds high: promotions compose with any base.

The effective plan does not depend on the order overlays were set in: every ``set`` overlay
replaces the base's formats of its sites (two setting one site: each operand the higher
precision of the two), then every ``raise`` overlay lifts the result; overlays of one kind are
taken in (owner, name) order, which also orders their names in the plan's ``method``. An overlay whose sites depend on the base (GNMR's: "these units, lifted one class up") is laid
as a **derived** overlay, ``derive(base sites) -> sites``, evaluated against the base in force
whenever the effective plan is composed: whoever sets the base, in whichever hook and in
whichever extension order, the derived overlay follows it at the same commit.

Methods call :meth:`PlanController.set_base` / :meth:`~PlanController.set_overlay` whenever
they like; nothing reaches the model until the precision platform commits, in the
``commit_step`` phase that follows every extension's ``before_step`` (the same step on every
rank), so a SNIP refresh can no longer silently undo another method's change: it replaces the
base, the overlays stay. The base, the overlays (a derived one as its sites over the current
base) and their owners are checkpoint state, restored exactly on resume. A ``derive`` that
changes the controller is refused (``RuntimeError``): composing must not depend on order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

import torch.distributed as dist

from megatron_ext.errors import UsageError
from megatron_ext.formats import get_format
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.site_formats import PASSTHROUGH, SiteFormats
from megatron_ext.sites import OPERANDS, ROLES

RULES = ("set", "raise")
"""How an overlay combines with the plan beneath it."""


def _precision(name: str) -> float:
    """Effective bits of a format name; no quantization ranks highest."""
    return float("inf") if name == PASSTHROUGH else get_format(name).effective_bits


def _higher(a: str, b: str) -> str:
    return b if _precision(b) > _precision(a) else a


def raise_formats(below: SiteFormats, above: SiteFormats) -> SiteFormats:
    """Each operand of ``below`` lifted to ``above``'s where that is higher precision."""
    roles = {r: _higher(getattr(below, r), getattr(above, r)) for r in ROLES}
    overrides = {}
    for op in OPERANDS:
        gemm, role = op.split(".")
        lifted = _higher(below.operand(gemm, role), above.operand(gemm, role))
        if lifted != roles[role]:
            overrides[op] = lifted
    return SiteFormats(**roles, overrides=tuple(overrides.items()))


@dataclass(frozen=True)
class Overlay:
    """Site formats one extension lays over the base plan."""

    owner: str
    """The extension that owns it (``precision``, ``gnmr``, ``faults`` ...)."""
    name: str
    """Its name within the owner (``keep-first-last``, ``promotions`` ...)."""
    sites: dict[str, SiteFormats] = field(default_factory=dict)
    """Site id -> the formats it sets or raises to."""
    rule: str = "set"
    """``set`` or ``raise`` (module docstring)."""
    derive: Callable[[Mapping[str, SiteFormats]], dict[str, SiteFormats]] | None = (
        field(default=None, compare=False))
    """``derive(base sites) -> sites``: the overlay's sites follow the base in force (None:
    ``sites`` as given); not checkpointed (the owner lays it again after a resume)."""

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"overlay rule must be one of {RULES}, got {self.rule!r}")

    def resolved(self, base: Mapping[str, SiteFormats]) -> "Overlay":
        """This overlay with ``sites`` evaluated against ``base`` (itself if not derived)."""
        if self.derive is None:
            return self
        return replace(self, sites=dict(self.derive(base)), derive=None)

    def to_dict(self) -> dict:
        return {"owner": self.owner, "name": self.name, "rule": self.rule,
                "sites": {sid: f.to_dict() for sid, f in self.sites.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "Overlay":
        sites = {sid: SiteFormats.from_dict(f) for sid, f in data["sites"].items()}
        return cls(data["owner"], data["name"], sites, data["rule"])


def compose(base: PrecisionPlan, overlays: list[Overlay]) -> PrecisionPlan:
    """The effective plan, the same for ``overlays`` in any order (module docstring): the
    ``set`` overlays' sites over ``base``, then the ``raise`` overlays lifting them; its method
    names the base and every non-empty overlay. Derived overlays are evaluated against
    ``base``."""
    resolved = [o.resolved(base.sites) for o in overlays]
    ordered = sorted((o for o in resolved if o.sites),
                     key=lambda o: (RULES.index(o.rule), o.owner, o.name))
    pinned: dict[str, SiteFormats] = {}  # the set overlays' sites
    for overlay in (o for o in ordered if o.rule == "set"):
        pinned.update({sid: raise_formats(pinned[sid], f) if sid in pinned else f
                       for sid, f in overlay.sites.items()})
    sites = {**base.sites, **pinned}
    for overlay in (o for o in ordered if o.rule == "raise"):
        sites.update({sid: raise_formats(sites.get(sid, SiteFormats()), f)
                      for sid, f in overlay.sites.items()})
    return base.replace(sites=sites, method="".join([base.method,
                                                     *(f"+{o.name}" for o in ordered)]))


class PlanController:
    """One run's base plan and overlays; :meth:`commit` makes them the plan in force."""

    def __init__(self):
        self.base: PrecisionPlan | None = None
        """The plan a policy made (None: the run has no precision plan)."""
        self.overlays: dict[tuple[str, str], Overlay] = {}
        """(owner, name) -> overlay (their order does not matter: :func:`compose`)."""
        self.applied: PrecisionPlan | None = None
        """The effective plan the model runs now (set by :meth:`commit`)."""
        self.linears_for: set[str] = set()
        """Owners that need every site to be the quantized linear even without a plan (their
        operand transforms live in it); with no plan its operands pass through untouched."""
        self.plan_needed: list[str] = []
        """Why extensions need a base plan (one line each); refused without one."""
        self.flags_read = False
        """Whether the platform has made the base plan of the flags (its ``validate``)."""
        self.stand_in = None
        """``stand_in(args, shape) -> PrecisionPlan``: what ``--dry-run`` assumes for a base
        plan only training decides (the base's policy's ``Policy.dry_run``; None: the base)."""
        self._composing = False
        """True while derived overlays are evaluated (they must not change the controller)."""

    def require_linears(self, owner: str) -> None:
        """``owner`` installs operand transforms: build the quantized linears (at validate)."""
        self.linears_for.add(owner)

    def _check_not_composing(self, what: str) -> None:
        if self._composing:
            raise RuntimeError(f"plan controller: {what} while an overlay is derived (a derive "
                               "function must only read the base it is given)")

    def require_plan(self, why: str) -> None:
        """An extension works on a base plan: ``why`` (one line) becomes the ``UsageError``
        of a run without one, whether the platform validates before or after the caller."""
        self.plan_needed.append(why)
        self.check_plan_needed()

    def check_plan_needed(self) -> None:
        if self.flags_read and self.base is None and self.plan_needed:
            raise UsageError(self.plan_needed[0])

    def set_base(self, plan: PrecisionPlan) -> None:
        self._check_not_composing("set_base")
        self.base = plan

    def set_overlay(self, owner: str, name: str, sites: dict[str, SiteFormats] | None = None,
                    rule: str = "set", derive=None) -> None:
        """Lay (or replace) ``owner``'s overlay ``name``: fixed ``sites``, or ``derive(base
        sites) -> sites`` evaluated at every commit (module docstring); empty keeps its
        place."""
        self._check_not_composing("set_overlay")
        self.overlays[(owner, name)] = Overlay(owner, name, dict(sites or {}), rule, derive)

    def overlay(self, owner: str, name: str) -> Overlay | None:
        return self.overlays.get((owner, name))

    def effective(self) -> PrecisionPlan | None:
        if self.base is None:
            return None
        self._composing = True
        try:
            return compose(self.base, list(self.overlays.values()))
        finally:
            self._composing = False

    def changes(self) -> list[str] | None:
        """Sites whose formats the next commit changes ([] if only the plan's metadata does),
        or None if the plan in force stays as it is."""
        plan = self.effective()
        if plan is None:
            return None
        if self.applied is None:
            return sorted(plan.sites)
        if plan.replace(stage_fp4_frac=self.applied.stage_fp4_frac) == self.applied:
            return None
        return sorted(sid for sid in set(plan.sites) | set(self.applied.sites)
                      if plan.formats(sid) != self.applied.formats(sid))

    def state_dict(self) -> dict:
        base = self.base.sites if self.base else {}
        return {"base": self.base.to_dict() if self.base else None,
                "overlays": [o.resolved(base).to_dict() for o in self.overlays.values()]}

    def load_state_dict(self, state: dict) -> None:
        if "plan" in state:  # checkpoints written before the controller: one plan, no overlays
            state = {"base": state["plan"], "overlays": []}
        self.base = PrecisionPlan.from_dict(state["base"]) if state["base"] else None
        self.overlays = {}
        for data in state["overlays"]:
            overlay = Overlay.from_dict(data)
            self.overlays[(overlay.owner, overlay.name)] = overlay


def verify_same_plan(plan: PrecisionPlan, group=None) -> None:
    """All-gather the plan hash over ``group`` (default: every rank); ``RuntimeError`` on
    every rank if any rank holds another plan."""
    hashes = [None] * dist.get_world_size(group)
    dist.all_gather_object(hashes, plan.hash, group=group)
    if len(set(hashes)) > 1:
        by_rank = ", ".join(f"rank {r}: {h[:12]}" for r, h in enumerate(hashes))
        raise RuntimeError(f"ranks hold different precision plans ({by_rank})")
