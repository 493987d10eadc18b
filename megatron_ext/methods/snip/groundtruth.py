"""The estimator check (SNIP Fig. 13): estimated ΔL / ΔW against measured ones, per site.

On a trained model and one fixed held-out global batch:

* **ΔL** — measured: quantize only site ``j``'s ``x`` and ``w`` (fprop) to the FP4 candidate,
  run the forward pass, ``|L_j - L| / L``; estimated: :func:`~megatron_ext.methods.snip.divergence.
  loss_divergence` of the option (x, w in FP4) from one refresh's statistics on that batch.
  The estimate is the RMS of a random first-order change, the measurement one draw of it
  (a half-normal spread: a factor of several either way per site), so both can be taken as
  the RMS over several held-out batches (``loss_batches``).
* **ΔW** — measured: from the same optimizer state, one AdamW step on the batch with only
  site ``j``'s backward operands in FP4, against the unquantized step:
  ``(1/S) Σ_l ‖W'_l - W_l‖ / ‖W_l‖`` over the ``S`` site weights; estimated:
  :func:`~megatron_ext.methods.snip.divergence.weight_divergences` of the all-FP4 option with the
  forward part left out (the measurement keeps fprop exact). Two readings of "the site's
  gradients quantized": **wgrad** — only the site's weight-gradient GEMM (``dy``, ``x``), so
  only its own weights move differently; **backward** — also its dgrad (``dy``, ``w``), whose
  error flows into every layer below.

Both are compared by Spearman rank correlation over the sites (the ILP only needs the
ranking and the relative sizes). For comparison the check also evaluates the paper's own
formula for the wgrad case, ``α c ‖A‖ ‖δg‖ / √(NK)`` with the isotropic ``‖δg‖² = Gdy + Gx``
(:func:`paper_weight_divergences`). Used by ``benchmarks/snip_estimator.py`` and its test.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch

from megatron_ext.precision.layers import apply_plan
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.methods.snip.divergence import (SiteStats, adam_step_size, loss_divergence,
                                          weight_divergences)
from megatron_ext.methods.snip.refresh import adam_statistics, collect, reduce_statistics
from megatron_ext.training import loop


@dataclass
class EstimatorCheck:
    """Per-site estimated and measured divergences, and their rank correlations."""

    sites: list[str]
    """Site ids in forward order."""
    est_dL: list[float]
    """SNIP's ΔL estimate of x, w in FP4."""
    true_dL: list[float]
    """Measured |ΔL| / L with the site's x, w in FP4."""
    est_dW: list[float]
    """SNIP's ΔW estimate of the backward operands in FP4."""
    true_dW: list[float]
    """Measured ΔW of one AdamW step with the site's backward operands in FP4."""
    est_dW_wgrad: list[float]
    """SNIP's ΔW estimate of the wgrad operands in FP4."""
    true_dW_wgrad: list[float]
    """Measured ΔW of one AdamW step with the site's wgrad operands in FP4."""
    est_dW_wgrad_paper: list[float]
    """The paper's isotropic ``‖A‖‖δg‖/√(NK)`` estimate of the wgrad case (§4.3.2)."""
    spearman_dL: float
    """Rank correlation of est_dL and true_dL."""
    spearman_dW: float
    """Rank correlation of est_dW and true_dW (backward)."""
    spearman_dW_wgrad: float
    """Rank correlation of est_dW_wgrad and true_dW_wgrad."""
    spearman_dW_wgrad_paper: float
    """Rank correlation of est_dW_wgrad_paper and true_dW_wgrad."""


def _loss(args, model, dataset, consumed: int = 0) -> float:
    return loop.run_schedule(args, model,
                             loop.data_iterators(args, dataset, consumed, len(model)),
                             forward_only=True)


def _collect_stats(args, run, dataset, consumed: int, candidates: dict, noise: float,
                   probe: str):
    """(reduced statistics, loss) of the global batch at ``consumed``."""
    observers, loss = collect(args, run, consumed, candidates, noise, dataset, probe=probe)
    return reduce_statistics(observers, args, candidates), loss


def _loss_divergences(args, run, dataset, x_w: SiteFormats, stats: list[SiteStats],
                      loss: float, consumed: int) -> tuple[list[float], list[float]]:
    """Estimated and measured ΔL of every site on the global batch at ``consumed``, whose
    statistics and loss are ``stats``, ``loss``."""
    measured = []
    for s in stats:
        apply_plan(run.model, PrecisionPlan({s.site: x_w}), args.num_layers)
        measured.append(abs(_loss(args, run.model, dataset, consumed) - loss) / loss)
    apply_plan(run.model, PrecisionPlan({}), args.num_layers)
    return [loss_divergence(s, x_w, loss) for s in stats], measured


def snapshot(run) -> tuple[list, dict]:
    params = [p.detach().clone() for c in run.model for p in c.parameters()]
    return params, copy.deepcopy(run.optimizer.optimizer.state_dict())


def restore(run, snap) -> None:
    params, opt_state = snap
    with torch.no_grad():
        for p, saved in zip((p for c in run.model for p in c.parameters()), params):
            p.copy_(saved)
    run.optimizer.optimizer.load_state_dict(copy.deepcopy(opt_state))


def _step(args, run, dataset) -> None:
    """One optimizer step on the held-out batch (no scheduler step)."""
    for chunk in run.model:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    loop.run_schedule(args, run.model, loop.data_iterators(args, dataset, 0, len(run.model)),
                      forward_only=False)
    run.optimizer.step()


def site_weights(run, sites) -> list[torch.Tensor]:
    from megatron_ext.precision.layers import quantized_linears
    linears = quantized_linears(run.model)
    return [linears[s].weight.detach().double().clone() for s in sites]


def weight_divergence(before, after) -> float:
    return float(np.mean([float((a - b).norm() / b.norm()) for a, b in zip(after, before)]))


def paper_weight_divergences(sites: list[SiteStats], o: SiteFormats,
                             hyper: dict) -> list[float]:
    """Each site's ΔW term from its own wgrad error with the paper's isotropic AdamW bound
    ``(1/S) α c ‖A‖ ‖δg‖ / (√(NK) ‖W‖)``, ``‖δg‖² = Gdy + Gx`` (for comparison only)."""
    step = adam_step_size(hyper)
    out = []
    for s in sites:
        st = s.stats
        dg = math.sqrt(st["Gdy"][o.dy] + st["Gx"][o.x])
        out.append(step * math.sqrt(st["AA"]) * dg / math.sqrt(s.n * s.k * st["ww"])
                   / len(sites))
    return out


def _rms(rows: list[list[float]]) -> list[float]:
    return [float(v) for v in np.sqrt(np.mean(np.square(rows), axis=0))]


def check(args, run, dataset, fp4: SiteFormats, high: SiteFormats, candidates: dict,
          noise: float, loss_batches: int = 1, probe: str = "isotropic") -> EstimatorCheck:
    """Run the check on ``dataset``'s first global batch (single process); ΔL as the RMS over
    the first ``loss_batches`` batches (a loss change is one random draw per batch);
    ``probe``: the backward probe's noise (``--snip-probe``)."""
    from scipy.stats import spearmanr

    num_layers = args.num_layers
    empty = PrecisionPlan({})
    apply_plan(run.model, empty, num_layers)
    snap = snapshot(run)
    observers, loss = collect(args, run, 0, candidates, noise, dataset, probe=probe)
    _step(args, run, dataset)  # the reference step: its AdamW state feeds the estimate
    hyper = adam_statistics(run.optimizer, run.model, observers)
    stats = reduce_statistics(observers, args, candidates)
    sites = [s.site for s in stats]
    reference = site_weights(run, sites)
    restore(run, snap)
    x_w = SiteFormats(fp4.x, fp4.w, high.dy)
    backward = SiteFormats(high.x, high.w, fp4.dy,
                           overrides=(("dgrad.w", fp4.w), ("wgrad.x", fp4.x)))
    wgrad = SiteFormats(high.x, high.w, high.dy,
                        overrides=(("wgrad.dy", fp4.dy), ("wgrad.x", fp4.x)))
    batches = [(stats, loss, 0)]
    for b in range(1, loss_batches):
        consumed = b * args.global_batch_size
        other, other_loss = _collect_stats(args, run, dataset, consumed, candidates, noise,
                                           probe)
        batches.append((other, other_loss, consumed))
    dl = [_loss_divergences(args, run, dataset, x_w, *batch) for batch in batches]
    est_dl, true_dl = _rms([e for e, _ in dl]), _rms([t for _, t in dl])
    est_dw = weight_divergences(stats, [fp4], hyper, include_forward=False)[:, 0]
    est_own = weight_divergences(stats, [fp4], hyper, False, include_dgrad=False)[:, 0]
    true_dw, true_own = [], []
    for sid in sites:
        for formats, out in ((backward, true_dw), (wgrad, true_own)):
            apply_plan(run.model, PrecisionPlan({sid: formats}), num_layers)
            _step(args, run, dataset)
            out.append(weight_divergence(reference, site_weights(run, sites)))  # Def. 4.4
            restore(run, snap)
    apply_plan(run.model, empty, num_layers)
    paper = paper_weight_divergences(stats, fp4, hyper)
    rho = lambda a, b: float(spearmanr(a, b).statistic)  # noqa: E731
    return EstimatorCheck(sites, est_dl, true_dl, [float(v) for v in est_dw], true_dw,
                          [float(v) for v in est_own], true_own, paper, rho(est_dl, true_dl),
                          rho(est_dw, true_dw), rho(est_own, true_own), rho(paper, true_own))
