"""The PGQ profile as a heatmap (``plot_precision.py pgq``): the SQNR of every GEMM operand.

One panel per candidate format; rows are the profiled layers in order — the embedding, each
linear site ``L{i}.{qkv,proj,fc1,fc2}``, the logits GEMM — and columns the six GEMM operands
``fprop.x fprop.w dgrad.dy dgrad.w wgrad.dy wgrad.x``; the colour is the SQNR in dB on one
scale for all panels, the number in a cell its value (``inf``: quantized exactly). The
embedding has two operands only (``fprop.w``: the table along the vocabulary, ``wgrad.dy``;
its one-hot operand is exact): the other cells are grey.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from megatron_ext.sites import OPERANDS
from megatron_ext.viz.plots import new_figure

ANNOTATE_ROWS = 40
"""Cells carry their value when a panel has at most this many rows."""


def sqnr_grid(profile, candidate: str) -> tuple[list[str], np.ndarray]:
    """(row labels, SQNR in dB [rows, 6]: NaN where a layer has no such operand, inf exact)."""
    rows = list(dict.fromkeys(g.site for g in profile.gemms))
    grid = np.full((len(rows), len(OPERANDS)), np.nan)
    for g in profile.gemms:
        for role, op in g.operands.items():
            ratio = op.sqnr[candidate]
            db = math.inf if ratio == math.inf else (10 * math.log10(ratio) if ratio > 0
                                                     else -math.inf)
            grid[rows.index(g.site), OPERANDS.index(f"{g.gemm}.{role}")] = db
    return rows, grid


def _annotate(ax, grid: np.ndarray, middle: float) -> None:
    for (row, col), value in np.ndenumerate(grid):
        if not np.isnan(value):
            text = "inf" if value == math.inf else f"{value:.0f}"
            ax.text(col, row, text, ha="center", va="center", fontsize=6,
                    color="white" if value < middle else "black")


def sqnr_heatmap(profile, candidates: list[str]) -> Figure:
    """One panel per candidate: layer x operand, colour = SQNR (dB)."""
    grids = {c: sqnr_grid(profile, c) for c in candidates}
    rows = next(iter(grids.values()))[0]
    finite = np.concatenate([g[np.isfinite(g)] for _, g in grids.values()])
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    fig = new_figure(1.8 + 2.6 * len(candidates), min(2.0 + 0.22 * len(rows), 30.0))
    cmap = colormaps["viridis"].with_extremes(bad="#d9d9d9", over="#fde725", under="#440154")
    axes = fig.subplots(1, len(candidates), squeeze=False, sharey=True)[0]
    for ax, candidate in zip(axes, candidates):
        grid = grids[candidate][1]
        image = ax.imshow(np.ma.masked_invalid(np.clip(grid, low - 1, high + 1)), aspect="auto",
                          interpolation="nearest", cmap=cmap, vmin=low, vmax=high)
        if len(rows) <= ANNOTATE_ROWS:
            _annotate(ax, grid, (low + high) / 2)
        ax.set_xticks(range(len(OPERANDS)), OPERANDS, rotation=90, fontsize=7)
        ax.set_title(candidate, fontsize=9)
    axes[0].set_yticks(range(len(rows)), rows, fontsize=7)
    fig.colorbar(image, ax=list(axes), fraction=0.04).set_label("SQNR (dB)")
    fig.suptitle(f"PGQ profile · step {profile.step} · {profile.steps} batch(es) · "
                 f"TP={profile.model.get('tp', 1)}", fontsize=9)
    return fig
