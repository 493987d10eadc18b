"""The PNGs of a comparison, in ``OUT/img`` (matplotlib's Agg canvas, written atomically).

* ``loss_<group>.png`` and ``loss_<group>_end.png`` — SNIP Fig. 8 in small: the mean over the
  seeds of every run's training loss (smoothed over ``T/20`` records, centred: see
  ``viz.plots.loss_curves``) and validation loss, per
  step, for the runs of one group together with the runs outside every group (the
  references); all steps, and the second half. Without ``group_by``: ``loss.png`` and
  ``loss_end.png`` with every run.
* ``gaps.png`` — each run's paired difference to the reference (mean over seeds, error bar =
  one standard error, the gap in % of the reference's loss written on the bar), bars coloured
  by group; only with a reference. The y axis spans at least ±:data:`GAP_AXIS_FLOOR_PCT` % of
  the reference's loss, so a 0.01 % gap is a small bar, not a full-height one.
* ``tradeoff.png`` — quality against the estimated step time (PGQ Fig. 5 in small): each run at
  the cost model's GEMM time relative to all-BF16 (x) and its paired difference to the
  reference (y; its final validation loss without a reference), whiskers one standard error,
  coloured by group and labelled with the run name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.compare.grid import Grid
from megatron_ext.compare.results import Metrics


@dataclass(frozen=True)
class MeanCurve:
    """A run's losses averaged over the seeds (what ``viz.plots.loss_curves`` draws)."""

    label: str
    """Legend label (the run name)."""
    train: tuple[tuple[int, float], ...]
    """(step, mean training loss) over the steps every seed logged."""
    val: tuple[tuple[int, float], ...]
    """(step, mean validation loss) over the steps every seed evaluated."""


def _mean_series(series: list[tuple[tuple[int, float], ...]]) -> tuple[tuple[int, float], ...]:
    per_seed = [dict(s) for s in series]
    steps = sorted(set.intersection(*(set(s) for s in per_seed)))
    return tuple((step, sum(s[step] for s in per_seed) / len(per_seed)) for step in steps)


def mean_curve(grid: Grid, metrics: Metrics, name: str) -> MeanCurve:
    """Run ``name``'s training and validation losses, mean over the grid's seeds."""
    runs = [metrics[name, s] for s in grid.seeds]
    return MeanCurve(name, _mean_series([m.train for m in runs]),
                     _mean_series([m.val for m in runs]))


def seeds_text(n: int) -> str:
    """``mean of 3 seeds`` / ``1 seed``."""
    return f"mean of {n} seeds" if n > 1 else "1 seed"


def _file_part(group: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", group)


def loss_figures(grid: Grid, metrics: Metrics, img: Path) -> list[Path]:
    """The loss curves of every group (see the module docstring)."""
    from megatron_ext.viz.plots import loss_curves, save_png

    groups: dict[str | None, list[str]] = {}
    for run in grid.runs:
        groups.setdefault(grid.group_of(run), []).append(run.name)
    outside = groups.pop(None, []) if len(groups) > 1 else []
    iters = max(m.train_iters for m in metrics.values())
    paths = []
    for group, names in groups.items():
        curves = [mean_curve(grid, metrics, n) for n in [*outside, *names]]
        stem = "loss" if group is None else f"loss_{_file_part(group)}"
        for suffix, start in (("", 0), ("_end", iters // 2)):
            fig = loss_curves(curves, smooth=max(1, iters // 20), from_step=start)
            title = fig.axes[0].get_title()
            within = f"{grid.group_by} {group}, " if group is not None else ""
            fig.axes[0].set_title(f"{within}{seeds_text(len(grid.seeds))}: {title}",
                                  fontsize=9)
            paths.append(img / f"{stem}{suffix}.png")
            save_png(fig, str(paths[-1]))
    return paths


GAP_AXIS_FLOOR_PCT = 0.5
"""The gaps' y axis spans at least ± this % of the reference's final validation loss."""


def gap_figure(results: dict, img: Path) -> Path | None:
    """``gaps.png`` (module docstring); None without a reference."""
    from megatron_ext.viz.plots import save_png

    fig = gap_plot(results)
    if fig is None:
        return None
    path = img / "gaps.png"
    save_png(fig, str(path))
    return path


def _gap_axis(ax, results: dict, runs: list) -> None:
    """Symmetric y limits, at least the floor; each bar labelled with its relative gap."""
    ref_loss = results["runs"][results["grid"]["reference"]]["val_loss"]["mean"]
    reach = max(abs(r["vs_reference"]["mean"]) + (r["vs_reference"]["se"] or 0.0)
                for _, r in runs)
    top = max(GAP_AXIS_FLOOR_PCT / 100 * abs(ref_loss), 1.2 * reach)
    ax.set_ylim(-top, top)
    for x, (_, run) in enumerate(runs):
        diff = run["vs_reference"]
        ax.annotate(f"{diff['rel_pct']:+.2f}%", (x, diff["mean"]), ha="center", fontsize=7,
                    va="bottom" if diff["mean"] >= 0 else "top",
                    xytext=(0, 2 if diff["mean"] >= 0 else -2), textcoords="offset points")


def gap_plot(results: dict):
    """Bars of the paired difference to the reference with standard-error whiskers."""
    from megatron_ext.viz.plots import new_figure

    ref = results["grid"]["reference"]
    runs = [(n, r) for n, r in results["runs"].items() if r["vs_reference"]]
    if not runs:
        return None
    groups = list(dict.fromkeys(r["group"] for _, r in runs))
    fig = new_figure(max(5.0, 0.45 * len(runs) + 2), 4.5)
    ax = fig.add_subplot()
    flag, labelled = results["grid"]["group_by"], set()
    for x, (name, run) in enumerate(runs):
        diff, group = run["vs_reference"], run["group"]
        label = None
        if flag and group not in labelled:
            label = f"{flag} {group}" if group is not None else f"without {flag}"
            labelled.add(group)
        ax.bar(x, diff["mean"], color=f"C{groups.index(group) % 10}", yerr=diff["se"],
               capsize=3, label=label)
    ax.axhline(0.0, color="black", linewidth=0.8)
    _gap_axis(ax, results, runs)
    ax.set_xticks(range(len(runs)), [n for n, _ in runs], rotation=60, ha="right",
                  fontsize=8)
    ax.set_ylabel(f"final val loss − {ref} (paired)")
    ax.grid(True, axis="y", alpha=0.3)
    if flag:
        ax.legend(fontsize=8)
    seeds = len(results["grid"]["seeds"])
    spread = "± standard error" if seeds > 1 else "no error bars: one seed cannot show noise"
    ax.set_title(f"gap to {ref}: {seeds_text(seeds)}, {spread}", fontsize=9)
    return fig


def tradeoff_points(results: dict) -> list[tuple[str, float, float, float | None, object]]:
    """``(run, GEMM time vs BF16, y, standard error of y, group)`` per run: y is the paired
    difference to the reference (0 for the reference itself), or the final validation loss
    when the grid has no reference."""
    points = []
    for name, run in results["runs"].items():
        if results["grid"]["reference"] is None:
            y, err = run["val_loss"]["mean"], run["val_loss"]["se"]
        else:
            diff = run["vs_reference"] or {"mean": 0.0, "se": None}
            y, err = diff["mean"], diff["se"]
        points.append((name, run["gemm_time_vs_bf16"], y, err, run["group"]))
    return points


def tradeoff_figure(results: dict, img: Path) -> Path:
    """Each run's quality against its estimated GEMM time (see the module docstring)."""
    from megatron_ext.viz.plots import new_figure, save_png

    ref, flag = results["grid"]["reference"], results["grid"]["group_by"]
    points = tradeoff_points(results)
    groups = list(dict.fromkeys(p[4] for p in points))
    fig = new_figure(6.5, 4.5)
    ax = fig.add_subplot()
    for name, x, y, err, group in points:
        ax.errorbar(x, y, yerr=err, fmt="o", color=f"C{groups.index(group) % 10}", capsize=3)
        ax.annotate(name, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("estimated GEMM time / all-BF16 (cost model)")
    ax.set_ylabel(f"final val loss − {ref} (paired)" if ref else "final val loss")
    ax.grid(True, alpha=0.3)
    grouped = f", colour = {flag}" if flag else ""
    ax.set_title(f"quality vs estimated step time: {seeds_text(len(results['grid']['seeds']))}"
                 f" ± standard error{grouped}", fontsize=9)
    path = img / "tradeoff.png"
    save_png(fig, str(path))
    return path


def draw(grid: Grid, results: dict, metrics: Metrics, out: Path) -> list[str]:
    """Every figure into ``out/img``; returns their paths relative to ``out``."""
    img = out / "img"
    img.mkdir(parents=True, exist_ok=True)
    paths = loss_figures(grid, metrics, img)
    gaps = gap_figure(results, img)
    paths += [*([gaps] if gaps else []), tradeoff_figure(results, img)]
    return [str(p.relative_to(out)) for p in paths]
