"""GNMR's controller cost as a share of the step time, measured in one run (not a test).

    python benchmarks/gnmr_overhead.py runs/gnmr_overhead           # analyse a finished run
    python benchmarks/gnmr_overhead.py runs/gnmr_overhead --train   # make the run, then analyse
    python benchmarks/gnmr_overhead.py runs/gnmr_site --train --extra --gnmr-granularity site

Every record of a ``--gnmr`` run carries ``gnmr_s``: the seconds GNMR spent on that step —
laying its overlay before the step, the float64 sums of squares of the owned weight
gradients inside the wrapped ``optimizer.step`` (before clipping), and after the step the
one all-reduce, Algorithm 1-2 and the trace line (``megatron_ext/methods/gnmr/extension.py``).
``step_time_s`` is the training step (forward, backward, optimizer: the squares included,
the hooks not). This reports, over the steps after the first ``--skip``:

* ``Σ gnmr_s / Σ step_time_s`` and the median of the per-step ratios (target <= 1 %);
* the medians of both in ms, and the steps where GNMR took over 10x its median (on a shared
  machine: the process was descheduled), with the sum ratio without them;
* what GNMR decided: promotions, the share of unit-steps run high, plan switches.

Not counted: the precision platform's commit of a changed plan (one per step whose promoted
set changed; it applies formats and writes ``precision_plan.json``), nor the cost of running
promoted units in higher precision (the method's cost, not the controller's). ``--train``
makes the run with :data:`TRAIN_FLAGS` through ``benchmarks/precision_quality.py``'s
:func:`train` (the embedded corpus, the tiny Llama, GNMR's default thresholds).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from precision_quality import read_metrics, report_main

TRAIN_FLAGS = ["--precision", "uniform:fp4", "--gnmr", "--train-iters", "150", "--seed", "1234",
               "--log-interval", "1", "--eval-iters", "0"]
"""The run ``--train`` makes."""


def report(run_dir: Path, skip: int) -> str:
    args = json.loads((run_dir / "args.json").read_text())
    records = {r["step"]: r for r in read_metrics(run_dir) if "gnmr_s" in r}  # last one wins
    steps = [records[t] for t in sorted(records) if t > skip]
    if not steps:
        raise SystemExit(f"{run_dir}: no records with gnmr_s after step {skip} (a --gnmr run "
                         "with --log-interval 1?)")
    gnmr = [r["gnmr_s"] for r in steps]
    step = [r["step_time_s"] for r in steps]
    units = args["num_layers"] * (4 if args.get("gnmr_granularity") == "site" else 1)
    high = sum(r["gnmr_units_high"] for r in steps) / (units * len(steps))
    switches = sum("precision_changed_sites" in r for r in steps)
    usual = [(g, s) for g, s in zip(gnmr, step) if g <= 10 * statistics.median(gnmr)]
    stalls = ", ".join(f"{1e3 * r['gnmr_s']:.0f} ms at step {r['step']}" for r in steps
                       if r["gnmr_s"] > 10 * statistics.median(gnmr))
    return "\n".join([
        f"{run_dir}: {len(steps)} steps after {skip}, {units} units "
        f"({args.get('gnmr_granularity') or 'block'}), {args['model']} model",
        f"- GNMR per step: median {1e3 * statistics.median(gnmr):.2f} ms; training step: "
        f"median {1e3 * statistics.median(step):.1f} ms",
        f"- controller cost: sum {100 * sum(gnmr) / sum(step):.3f} % of the step time, "
        f"median per step {100 * statistics.median(g / s for g, s in zip(gnmr, step)):.3f} % "
        f"(target <= 1 %)",
        f"- steps over 10x the median GNMR time: {stalls or 'none'}; without them the sum is "
        f"{100 * sum(g for g, _ in usual) / sum(s for _, s in usual):.3f} %",
        f"- decisions: {sum(r['gnmr_promotions'] for r in steps)} promotions, "
        f"{100 * high:.2f} % of unit-steps high, {switches} plan switches",
    ]) + "\n"


if __name__ == "__main__":
    report_main(__doc__, TRAIN_FLAGS, report)
