"""The GNMR figure of ``plot_precision.py gnmr``: the metrics over training and the raster of
promotions (the GNMR paper's Fig. 2-3, plus what the controller did with them).

Three panels over the training steps, from a run's ``gnmr/trace.jsonl``
(:func:`megatron_ext.viz.inputs.load_gnmr_trace`):

1. GNMR_t of every unit (thin lines, darker = deeper unit), their mean over units (black:
   the paper's Fig. 3 "average GNMR across operators") and the threshold α_t (red, dashed;
   ``1 + α_t`` for a run with ``--gnmr-compare excess``, where the trigger is
   ``GNMR - 1 > α``);
2. Δ-GNMR_t likewise, with β_t;
3. the promotion raster: unit (rows) x step, filled where the decision after that step put
   the unit in high precision (so a cell is the precision of the *next* step); skipped,
   non-finite steps are marked red on every panel.

The title gives the share of unit-steps run high and the number of promotions.
"""

from __future__ import annotations

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from megatron_ext.viz.plots import new_figure, row_axis

RASTER_COLORS = ("#eeeeee", "#c44e52")
"""Low, high."""


def promotions(high: np.ndarray) -> int:
    """Low-to-high switches in a [unit, step] raster (a unit high after the first step
    counts: every run starts low)."""
    padded = np.concatenate([np.zeros((high.shape[0], 1), dtype=bool), high], axis=1)
    return int((padded[:, 1:] & ~padded[:, :-1]).sum())


def _metric_panel(ax, trace, key: str, threshold: np.ndarray, label: str) -> None:
    steps = np.array(trace.steps)
    values = trace.values[key]
    shades = colormaps["viridis"](np.linspace(0.85, 0.1, len(trace.units)))
    for row, unit in enumerate(trace.units):
        ax.plot(steps, values[row], color=shades[row], linewidth=0.7, alpha=0.8,
                label=unit if len(trace.units) <= 8 else None)
    finite = np.isfinite(values)
    count = finite.sum(axis=0)
    mean = np.where(finite, values, 0.0).sum(axis=0) / np.maximum(count, 1)
    mean[count == 0] = np.nan
    ax.plot(steps, mean, color="black", linewidth=1.6, label="mean over units")
    offset = 1.0 if trace.compare == "excess" else 0.0
    ax.step(steps, threshold + offset, where="mid", color="#d62728", linestyle="--",
            linewidth=1.2, label=f"threshold ({trace.compare})")
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)


def _raster(ax, trace) -> None:
    first, last = trace.steps[0], trace.steps[-1]
    grid = np.full((len(trace.units), last - first + 1), np.nan)
    grid[:, np.array(trace.steps) - first] = trace.high
    cmap = ListedColormap(RASTER_COLORS).with_extremes(bad="white")
    ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap,
              vmin=0, vmax=1, extent=(first - 0.5, last + 0.5, len(trace.units) - 0.5, -0.5))
    row_axis(ax, list(trace.units))
    ax.set_xlabel("step (a filled cell: high precision for the next step)")


def gnmr_traces(trace) -> Figure:
    """The three panels of the module docstring for one trace."""
    rows = len(trace.units)
    fig = new_figure(9.0, 6.0 + min(0.15 * rows, 8.0))
    grid = fig.add_gridspec(3, 1, height_ratios=[2, 2, max(1.5, min(0.15 * rows, 8.0))])
    gnmr_ax = fig.add_subplot(grid[0])
    dgnmr_ax = fig.add_subplot(grid[1], sharex=gnmr_ax)
    raster_ax = fig.add_subplot(grid[2], sharex=gnmr_ax)
    _metric_panel(gnmr_ax, trace, "gnmr", trace.alpha, "GNMR")
    _metric_panel(dgnmr_ax, trace, "dgnmr", trace.beta, "Δ-GNMR")
    _raster(raster_ax, trace)
    for ax in (gnmr_ax, dgnmr_ax, raster_ax):
        for step in trace.nonfinite:
            ax.axvline(step, color="red", linewidth=0.8, alpha=0.6)
    share = 100.0 * trace.high.mean()
    skipped = f" · {len(trace.nonfinite)} non-finite step(s)" if trace.nonfinite else ""
    gnmr_ax.set_title(f"GNMR · {rows} units · steps {trace.steps[0]}-{trace.steps[-1]} · "
                      f"{share:.2f}% of unit-steps high · {promotions(trace.high)} "
                      f"promotions{skipped}", fontsize=10)
    return fig
