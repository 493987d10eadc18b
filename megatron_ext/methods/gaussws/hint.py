"""A PrecisionPlan suggested by the bit widths a ``--gaussws`` run learned.

GaussWS trains a bit width b_t per 32 x 32 weight tile: the weight decay on b_i pulls it
towards b_target (eq. 9) and the loss pushes it up where the noise of that width hurts
(eq. 3). Where it settles says how much rounding noise a site's weight tolerated in that run
(the paper's §4.4: later layers and the feed-forward output need more). The hint turns the
end-of-run widths into a plan:

* a sampled site whose b_t (by default its *largest* tile, ``--stat max``: every block) is at
  most ``fp4_max_bits`` (4) at the last logged step is an **FP4 candidate**: its weight (or
  with ``roles="all"`` every operand) in ``uniform:fp4``'s formats, the rest FP8;
* every other site of the model — sampled with wider b_t, or not sampled at all (``od``
  samples only ``proj`` and ``fc2``) — gets ``uniform:fp8``'s formats.

b_t describes the *weight* only (GaussWS perturbs w), so ``roles="w"`` is the default; the
activations and gradients of an FP4 candidate are not judged by it. Eq. 6 caps b_t by the
run's weight format (9 in BF16, 5 under an FP8 plan), so widths that sit at the cap say
"at least this", not "this". A suggestion: check it with ``--precision-plan`` and a loss
comparison (``tools/compare_precision.py``).
"""

from __future__ import annotations

from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.sites import all_site_ids, parse_site_id

ROLE_CHOICES = ("w", "all")
"""What an FP4 candidate puts in FP4: its weight only, or x, w and dy."""
METHOD = "gaussws-hint"


def fp4_candidates(history, fp4_max_bits: float, stat: str) -> dict[str, float]:
    """Sampled site -> its end-of-run b_t ``stat``, for the sites at or below the bound."""
    final = history.final(stat)
    return {sid: float(b) for sid, b in zip(history.sites, final) if b <= fp4_max_bits}


def candidate_formats(roles: str) -> SiteFormats:
    """An FP4 candidate's formats: ``uniform:fp8`` with the weight (``w``) or every operand
    (``all``) of ``uniform:fp4``."""
    if roles not in ROLE_CHOICES:
        raise ValueError(f"roles must be one of {', '.join(ROLE_CHOICES)}, got {roles!r}")
    if roles == "all":
        return UNIFORM["fp4"]
    fp8 = UNIFORM["fp8"]
    return SiteFormats(fp8.x, UNIFORM["fp4"].w, fp8.dy)


def hint_plan(history, num_layers: int, fp4_max_bits: float = 4.0, stat: str = "max",
              roles: str = "w") -> PrecisionPlan:
    """The plan of the module docstring for a ``num_layers``-layer model."""
    highest = max(parse_site_id(sid)[0] for sid in history.sites)
    if highest >= num_layers:
        raise ValueError(f"the run samples layer {highest}; --num-layers {num_layers} is too few")
    fp4 = fp4_candidates(history, fp4_max_bits, stat)
    small = candidate_formats(roles)
    sites = {sid: small if sid in fp4 else UNIFORM["fp8"] for sid in all_site_ids(num_layers)}
    return PrecisionPlan(sites, method=METHOD, step=history.steps[-1])
