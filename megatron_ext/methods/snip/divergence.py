"""SNIP step 4: loss divergence ΔL and weight divergence ΔW of every site x option.

Inputs are the reduced statistics of :mod:`megatron_ext.methods.snip.stats` (sums of squares over the
global batch) and :mod:`megatron_ext.methods.snip.adam`. Everything here is float64 arithmetic on
scalars; the model is not touched, so this runs on one rank in a background thread.

Modelling a quantization error as a random perturbation (SNIP §4.1), Theorem 4.1 gives the
change of a smooth function for an isotropic error ``δ`` of norm ‖δ‖ in ``d`` dimensions as
``‖∇g‖ ‖δ‖ / √d``. Applied per row (§6.3), for independent rows the variances add:

**Loss divergence** (§4.2, Definition 4.3), option ``o = (f_x, f_w, f_dy)`` at site ``j``::

    ΔL_x² = Σ_m ‖dx_m‖² ‖δx_m‖² / K            = Lx[f_x] / K
    ΔL_w² = Σ_n ‖dw_n‖² ‖δw_n‖² / K            = Lw[f_w] / K
    ΔL    = √(ΔL_x² + ΔL_w²) / |L|              (cross term dropped, as in §4.2)

**Weight-gradient errors** (§4.3.1). The gradient of every site ``l`` at or below ``j`` is
perturbed. Three parts, each the Theorem-4.1 norm of a bilinear map with one operand
perturbed:

* the site's own wgrad ``dw = dy^T x``, measured as the error GEMMs themselves (no probe
  needed), weighted by AdamW's derivative element by element (below)::

      ‖A ⊙ δg_j‖²_own = ‖A ⊙ (δdy^T x)‖² + ‖A ⊙ (dy^T δx)‖²  = WGdy[f_dy] + WGx[f_x]

* its dgrad error ``δdx = δdy·w + dy·δw`` that flows down into the layers below, again the
  exact norms of the error GEMMs::

      e_B² = ‖δdy·w‖² + ‖dy·δw‖²  = Bdyw[f_dy] + Bw[f_w]

  Both drop only the cross term of the two operands' errors (an option picks their formats
  independently). Not the random-sign expectations ``Σ_m ‖δdy_m‖² ‖x_m‖²`` /
  ``Σ_n ‖δdy_{:,n}‖² ‖w_n‖²``: round-to-nearest errors of a per-tensor format are
  correlated across tokens, so they add coherently (:mod:`megatron_ext.methods.snip.stats`)

* its forward error ``δy = δx·w^T + x·δw^T`` that changes the loss and every gradient::

      e_F² = ‖δx‖² ‖w‖² / K + ‖x‖² ‖δw‖² / K                  = ex ww / K + xx ew / K

How ``e_B`` and ``e_F`` reach site ``l``'s gradient is the second-order term
``‖∇_{X_j} g_l‖`` of §4.3.1. The dgrad error takes two paths:

* **within the layer** the dgrad error of ``fc2`` is the ``dy`` error of ``fc1`` (through the
  SwiGLU backward), that of ``proj`` the ``dy`` error of ``qkv`` (through attention). The
  step-2 probe (noise ``ξ`` as the residual-stream gradient at the top; the backward is
  linear, so every gradient is the response to ``ξ`` alone) excites every layer's ``fc2`` /
  ``proj`` with a random ``dy``, whose ``Δdx = Δdy·w`` has the shape of a dgrad error; the
  predecessor's response to it is measured in the same pass. So the in-layer transfer is
  ``‖A_p ⊙ Δg_p‖² / ‖Δdx_j‖²`` (``dgAB_p / dxB_j``), times ``e_B²``;
* **into the residual stream** at the *entry site* ``r`` of the branch (``qkv`` or ``fc1``:
  the site itself or its predecessor), through the norm in front of it, whose gain for an
  isotropic error is κ² per row (:mod:`megatron_ext.methods.snip.stats`). A ``qkv`` / ``fc1`` error
  enters as ``e_R² = e_B² · Σ_m ‖dx_m‖² κ_m² / ‖dx‖²`` (``dxdxN / dxdx``), an ``fc2`` /
  ``proj`` error as the probe's did: ``e_R² = e_B² · dxBN_r / dxB_j``. From there it reaches
  every site below ``r``: the probe gives site ``l`` the gradient ``Δg_l`` and the residual
  point in front of ``r``'s norm the gradient ``Δh_r`` (``resB``); everything from above
  reaches the layers below ``r`` through that one point, so the gain from ``r`` to ``l`` is
  ``GA_B(r, l)² = ‖A_l ⊙ Δg_l‖² / ‖Δh_r‖²``. **Our approximation**: these gains are the same
  for the quantization error as for the probe's response (both isotropic).

The forward error is carried like the step-3 probe (noise ``ν`` on the last ``fc2``'s input):
``GA_F(l)² = ‖A_l ⊙ Δg_l‖² / ‖ν‖²`` for every site at or below ``j`` (**approximation**: an
error entering at ``j`` reaches the sites with the gain measured from the top). "At or below"
is the paper's (§4.3.1: ``g_l(X_j, ...)`` for ``j ≥ l``); a forward error also changes the input
of every site above ``j``, which the multi-step ground truth shows matters: the estimate falls
short up to 13x at the first layer (docs/snip.md; ``forward_reach="all"`` is the what-if).

**Weight divergence** (§4.3.2, Definition 4.4) through AdamW's derivative ``α c A``
(:mod:`megatron_ext.methods.snip.adam`), kept element-wise::

      ΔW = (1/S) Σ_l α c ‖A_l ⊙ δg_l‖ / ‖W_l‖,   c = √(1-β2^t)/(1-β1^t)

The paper writes ``‖A ⊙ δg‖ ≈ ‖A‖ ‖δg‖ / √(NK)`` (isotropic ``δg``); that overstates sites
whose ``A`` is dominated by a few weights with ``v ≈ 0`` (and ``g ≈ 0``). Instead each part of
``δg`` is weighted by ``A²`` where it lands: the own wgrad error element by element
(``WGdy + WGx``, :mod:`megatron_ext.methods.snip.stats`), the propagated ones as above::

      ‖A_l ⊙ δg_l‖² = [l = j] (WGdy + WGx) + [l = pred(j)] e_B² dgAB_l / dxB_j
                      + [l < r(j)] e_R² GA_B(r(j), l)² + [l <= j] e_F² GA_F(l)²

with ``S`` the number of sites. **Quality loss** ``Q = w_L ΔL + w_W ΔW`` (§5.1, weights 1
by default).

The baselines of §6.1 read the same statistics: ``abs_error`` is ``Σ_roles ‖δ‖`` of the
option's formats, ``rel_error`` ``Σ_roles ‖δ‖/‖t‖``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_ext.precision.site_formats import SiteFormats


@dataclass(frozen=True)
class SiteStats:
    """Reduced statistics of one site (:mod:`megatron_ext.methods.snip.stats` names)."""

    site: str
    """Site id ``L{i}.{name}``, in forward order within the list."""
    n: int
    """Output features N of the site's weight (unsharded)."""
    k: int
    """Input features K of the site's weight (unsharded)."""
    stats: dict
    """Scalars (``xx``, ``ww``, ...) and per-format dicts (``Lx``, ``ew``, ...)."""


@dataclass(frozen=True)
class Divergence:
    """ΔL, ΔW and Q of one site under one option."""

    dL: float
    """Normalised loss divergence (Definition 4.3)."""
    dW: float
    """This site's contribution to the normalised weight divergence (Definition 4.4)."""
    q: float
    """Quality loss w_L ΔL + w_W ΔW."""


def _safe_div(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def loss_divergence(s: SiteStats, o: SiteFormats, loss: float) -> float:
    """ΔL of §4.2 for option ``o``."""
    st = s.stats
    return math.sqrt((st["Lx"][o.x] + st["Lw"][o.w]) / s.k) / max(abs(loss), 1e-30)


def _gradient_errors(s: SiteStats, o: SiteFormats) -> tuple[float, float, float]:
    """(‖A ⊙ δg_j‖²_own, e_B², e_F²) of option ``o``."""
    st = s.stats
    own = st["WGdy"][o.dy] + st["WGx"][o.x]
    e_b = st["Bdyw"][o.dy] + st["Bw"][o.w]
    e_f = (st["ex"][o.x] * st["ww"] + st["xx"] * st["ew"][o.w]) / s.k
    return own, e_b, e_f


_PREDECESSOR = {"fc2": "fc1", "proj": "qkv"}
"""Site -> the site of the same layer whose ``dy`` its ``dx`` becomes."""


def _predecessors(sites: list[SiteStats]) -> list[int | None]:
    index = {s.site: i for i, s in enumerate(sites)}
    out = []
    for s in sites:
        layer, _, name = s.site.partition(".")
        out.append(index.get(f"{layer}.{_PREDECESSOR[name]}") if name in _PREDECESSOR else None)
    return out


def adam_step_size(hyper: dict) -> float:
    """``α c``, AdamW's learning rate times its bias correction ``√(1-β2^t)/(1-β1^t)``."""
    t = max(hyper["step"], 1.0)
    return hyper["lr"] * math.sqrt(1 - hyper["beta2"] ** t) / (1 - hyper["beta1"] ** t)


FORWARD_REACH = ("below", "all")
"""Which sites' gradients a forward error at site j changes in the ΔW estimate: ``below``, the
sites at or below j (the paper's §4.3.1, the method's), or ``all`` (it also changes the input
of every site above j; a what-if, ``benchmarks/snip_multistep.py --reestimate``)."""


def weight_divergences(sites: list[SiteStats], options: list[SiteFormats], hyper: dict,
                       include_forward: bool = True, include_dgrad: bool = True,
                       forward_reach: str = "below") -> np.ndarray:
    """ΔW[site, option] of §4.3 (array of shape sites x options); ``include_forward=False``
    leaves out the forward error ``e_F`` (an option whose fprop stays exact),
    ``include_dgrad=False`` the dgrad error ``e_B`` (only the site's own wgrad quantized),
    ``forward_reach``: :data:`FORWARD_REACH`."""
    if forward_reach not in FORWARD_REACH:
        raise ValueError(f"forward_reach: expected one of {FORWARD_REACH}, got {forward_reach!r}")
    step = adam_step_size(hyper)
    scale = np.array([step * _safe_div(1.0, math.sqrt(s.stats["ww"])) for s in sites])
    noise_f = sum(s.stats["noiseF"] for s in sites)
    response_b = np.array([s.stats["dgAB"] for s in sites])
    gain_f = np.array([_safe_div(s.stats["dgAF"], noise_f) for s in sites])
    pred = _predecessors(sites)
    out = np.zeros((len(sites), len(options)))
    for j, s in enumerate(sites):
        entry = j if pred[j] is None else pred[j]
        below = np.arange(len(sites)) < entry
        upto = np.arange(len(sites)) <= (j if forward_reach == "below" else len(sites))
        for i, o in enumerate(options):
            own, e_b, e_f = _gradient_errors(s, o)
            e_b = e_b if include_dgrad else 0.0
            if pred[j] is None:  # qkv, fc1: the norm's gain on this site's dx error
                e_r = e_b * _safe_div(s.stats["dxdxN"], s.stats["dxdx"])
            else:  # fc2, proj: through the predecessor, as the probe's response went
                e_r = e_b * _safe_div(sites[entry].stats["dxBN"], s.stats["dxB"])
            e_r = _safe_div(e_r, sites[entry].stats["resB"])
            dg2 = e_r * response_b * below + (e_f * gain_f * upto if include_forward else 0.0)
            dg2[j] += own
            if pred[j] is not None:
                dg2[pred[j]] += e_b * _safe_div(response_b[pred[j]], s.stats["dxB"])
            out[j, i] = float(np.sum(scale * np.sqrt(dg2))) / len(sites)
    return out


def divergences(sites: list[SiteStats], options: list[SiteFormats], loss: float,
                hyper: dict, weight_loss: float = 1.0, weight_weight: float = 1.0
                ) -> list[list[Divergence]]:
    """``[site][option]`` ΔL, ΔW and Q for every site and option."""
    dw = weight_divergences(sites, options, hyper)
    out = []
    for j, s in enumerate(sites):
        row = []
        for i, o in enumerate(options):
            dl = loss_divergence(s, o, loss)
            row.append(Divergence(dl, float(dw[j, i]),
                                  weight_loss * dl + weight_weight * float(dw[j, i])))
        out.append(row)
    return out


def quantization_errors(s: SiteStats, o: SiteFormats, relative: bool) -> float:
    """The min-abs-err / min-rel-err baselines' quality: Σ over roles of ‖δ‖ (or ‖δ‖/‖t‖)."""
    st = s.stats
    parts = ((st["ex"][o.x], st["xx"]), (st["ew"][o.w], st["ww"]),
             (st["Bdy"][o.dy], st["dydy"]))
    return sum(math.sqrt(err) / (math.sqrt(ref) if relative and ref > 0 else 1.0)
               for err, ref in parts)
