"""Multi-step ground truth: one site's option in FP4 for N training steps against none.

SNIP's ΔW (Definition 4.4) is the weight divergence of **one** AdamW step, and its ILP weighs
it against ΔL per step (Q = ΔL + ΔW, §5.1), while a plan stays in place for a whole refresh
interval. If an option's error has a consistent sign from step to step (per-tensor round to
nearest flushes the same small ``dy`` entries to zero every step), its damage grows like N;
a random error grows like √N. :func:`measure` measures which, on a loaded checkpoint:

* **reference**: N steps of training from the checkpoint (its optimizer state and learning
  rate schedule, the training data in order from its position), nothing quantized;
* **per site and option**: the same N steps with only that site under that option
  (:class:`~megatron_ext.precision.site_formats.SiteFormats`, every GEMM that reads a role);

and after each N of ``steps``: the weight divergence ``(1/S) Σ_l ‖W'_l - W_l‖ / ‖W_l‖``
over the ``S`` site weights against the reference at the same step (Definition 4.4), and the
held-out loss (the first ``eval_batches`` validation batches) minus the reference's, with
nothing quantized (the weights' damage, ``dloss``) and with the option in place (what a run's
validation sees, ``dloss_plan``). Alongside, SNIP's one-step estimates of the same options
(ΔL, ΔW, Q) from one refresh on the checkpoint's next training batch, with the AdamW state
after that step (as in training). Used by ``benchmarks/snip_multistep.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_ext.precision.layers import apply_plan
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.methods.snip.divergence import SiteStats, divergences
from megatron_ext.methods.snip.groundtruth import restore, site_weights, snapshot, weight_divergence
from megatron_ext.methods.snip.refresh import adam_statistics, collect, reduce_statistics
from megatron_ext.training import loop


@dataclass
class MultiStepTruth:
    """SNIP's one-step estimates and the measured N-step effects, per option and site."""

    sites: list[str]
    """Site ids measured, in forward order."""
    options: list[str]
    """Option names (``option_name``: x/w/dy formats)."""
    steps: list[int]
    """The N at which the effects were measured, ascending."""
    est_dL: list[list[float]]
    """[option][site] SNIP's ΔL (Definition 4.3) from one refresh."""
    est_dW: list[list[float]]
    """[option][site] SNIP's one-step ΔW (Definition 4.4)."""
    dW: list[list[list[float]]]
    """[option][site][n] measured weight divergence after ``steps[n]`` steps."""
    dloss: list[list[list[float]]]
    """[option][site][n] held-out loss minus the reference's, evaluated unquantized."""
    dloss_plan: list[list[list[float]]]
    """[option][site][n] the same, evaluated with the option in place."""
    ref_loss: list[float]
    """[n] the reference's held-out loss after ``steps[n]`` steps."""


def _scheduler_steps(run) -> int:
    return run.scheduler.num_steps


def _set_scheduler(run, num_steps: int) -> None:
    run.scheduler.num_steps = num_steps
    run.scheduler.step(increment=0)  # sets the learning rate of that step again


@torch.no_grad()
def heldout_loss(args, model, dataset, batches: int) -> float:
    """Mean loss over the first ``batches`` global batches of ``dataset`` (forward only)."""
    iterator = loop.data_iterators(args, dataset, 0, len(model))
    return sum(loop.run_schedule(args, model, iterator, forward_only=True)
               for _ in range(batches)) / batches


def trajectory(args, run, plan: PrecisionPlan, steps: list[int], eval_batches: int,
               sites: list[str]) -> list[tuple[list[torch.Tensor], float, float]]:
    """Train ``max(steps)`` steps under ``plan`` from the current state and data position;
    after each N of ``steps``: (site weights, held-out loss unquantized, with ``plan``).
    The caller restores the state."""
    iterator = loop.data_iterators(args, run.datasets[0], run.state.consumed_samples,
                                   len(run.model))
    out = []
    for n in range(1, max(steps) + 1):
        apply_plan(run.model, plan, args.num_layers)
        loop.train_step(args, run.model, run.optimizer, run.scheduler, iterator)
        if n in steps:
            with_plan = heldout_loss(args, run.model, run.datasets[1], eval_batches)
            apply_plan(run.model, PrecisionPlan({}), args.num_layers)
            high = heldout_loss(args, run.model, run.datasets[1], eval_batches)
            out.append((site_weights(run, sites), high, with_plan))
    apply_plan(run.model, PrecisionPlan({}), args.num_layers)
    return out


def refresh_at(args, run, candidates: dict, noise: float, probe: str = "isotropic"
               ) -> tuple[list[SiteStats], float, dict]:
    """(statistics, loss, AdamW hyper-parameters) of one refresh on the next training batch,
    AdamW's state taken after one step on it (as in training); the state is restored after."""
    saved, lr_step = snapshot(run), _scheduler_steps(run)
    apply_plan(run.model, PrecisionPlan({}), args.num_layers)
    consumed = run.state.consumed_samples
    observers, loss = collect(args, run, consumed, candidates, noise, probe=probe)
    iterator = loop.data_iterators(args, run.datasets[0], consumed, len(run.model))
    loop.train_step(args, run.model, run.optimizer, run.scheduler, iterator)
    hyper = adam_statistics(run.optimizer, run.model, observers)
    stats = reduce_statistics(observers, args, candidates)
    restore(run, saved)
    _set_scheduler(run, lr_step)
    return stats, loss, hyper


def measure(args, run, refresh: tuple[list[SiteStats], float, dict],
            options: dict[str, SiteFormats], sites: list[str], steps: list[int],
            eval_batches: int) -> MultiStepTruth:
    """The one-step estimates (from ``refresh``, :func:`refresh_at`) and the N-step effects
    of every option at every site in ``sites`` (single process); the run's state is the
    checkpoint's again afterwards."""
    steps = sorted(steps)
    names, formats = list(options), list(options.values())
    stats, loss, hyper = refresh
    all_sites = [s.site for s in stats]
    table = divergences(stats, formats, loss, hyper)
    rows = [all_sites.index(s) for s in sites]
    saved, lr_step = snapshot(run), _scheduler_steps(run)
    ref = trajectory(args, run, PrecisionPlan({}), steps, eval_batches, all_sites)
    restore(run, saved)
    _set_scheduler(run, lr_step)
    dw, dloss, dloss_plan = ([[[] for _ in sites] for _ in names] for _ in range(3))
    for i, fmt in enumerate(formats):
        for j, sid in enumerate(sites):
            traj = trajectory(args, run, PrecisionPlan({sid: fmt}), steps, eval_batches,
                              all_sites)
            restore(run, saved)
            _set_scheduler(run, lr_step)
            for (w, high, plan), (w_ref, ref_high, _) in zip(traj, ref):
                dw[i][j].append(weight_divergence(w_ref, w))
                dloss[i][j].append(high - ref_high)
                dloss_plan[i][j].append(plan - ref_high)
    return MultiStepTruth(list(sites), names, steps,
                          [[table[r][i].dL for r in rows] for i in range(len(names))],
                          [[table[r][i].dW for r in rows] for i in range(len(names))],
                          dw, dloss, dloss_plan, [r[1] for r in ref])


def growth_exponent(steps: list[int], effects: list[float]) -> float:
    """Least-squares slope of log |effect| against log N (1: grows like N, coherent;
    0.5: like √N, a random walk); NaN when an effect is 0."""
    y = np.abs(np.asarray(effects, dtype=float))
    if len(steps) < 2 or np.any(y <= 0):
        return float("nan")
    return float(np.polyfit(np.log(steps), np.log(y), 1)[0])
