"""The STQuant figure of ``plot_precision.py stquant``: the optimizer-state width of every
layer over training (the STQuant paper's Fig. 6a).

Rows are the run's quantized parameter tensors in model order — the embedding, then per
transformer layer ``L<i>.qkv / proj / fc1 / fc2`` (the order a token meets them), then the
output layer — and columns the training steps from the first assignment to one assignment
interval (the median gap between assignments) past the last: a width holds from the step that
assigned it until the next assignment, so the last one is drawn as wide as a typical interval
instead of one step (read by :func:`megatron_ext.viz.inputs.load_widths`).
"""

from __future__ import annotations

import re
import statistics

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from megatron_ext.sites import SITES
from megatron_ext.viz.plots import new_figure, row_axis

WIDTH_COLORS = {4: "#deebf7", 8: "#9ecae1", 16: "#3182bd", 32: "#08306b"}
"""Light (4 bits) to dark (32 bits)."""
_STACKED = re.compile(r"^decoder\.layers\.(?:.*\.)?(?:linear_)?(\w+)\.weight\[(\d+)\]$")


def short_name(layer: str) -> str:
    """``decoder.layers.mlp.linear_fc1.weight[3]`` -> ``L3.fc1``; the embedding and output
    layer by their role; anything else without its ``.weight``."""
    match = _STACKED.match(layer)
    if match:
        return f"L{match.group(2)}.{match.group(1)}"
    if layer.startswith("embedding."):
        return "embedding"
    if layer.startswith("output_layer."):
        return "output"
    return layer.removesuffix(".weight")


def _order(name: str) -> tuple:
    if name == "embedding":
        return (0, 0, 0, name)
    if name == "output":
        return (2, 0, 0, name)
    match = re.match(r"^L(\d+)\.(\w+)$", name)
    if not match:
        return (1, 10 ** 9, 0, name)
    site = match.group(2)
    return (1, int(match.group(1)), SITES.index(site) if site in SITES else len(SITES), name)


def _last_step(steps: tuple[int, ...]) -> int:
    """The last column: one median assignment interval past the last assignment."""
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    return steps[-1] + max(1, int(statistics.median(gaps))) - 1 if gaps else steps[-1]


def width_history(history) -> Figure:
    """Heatmap of the module docstring."""
    names = [short_name(layer) for layer in history.layers]
    rows = sorted(range(len(names)), key=lambda i: _order(names[i]))
    steps = np.arange(history.steps[0], _last_step(history.steps) + 1)
    column = np.searchsorted(np.array(history.steps), steps, side="right") - 1
    grid = history.bits[rows][:, column]
    codes = np.searchsorted(sorted(WIDTH_COLORS), grid)
    fig = new_figure(9.0, 2.0 + min(0.18 * len(rows), 10.0))
    ax = fig.add_subplot()
    ax.imshow(codes, aspect="auto", interpolation="nearest", vmin=-0.5,
              vmax=len(WIDTH_COLORS) - 0.5, cmap=ListedColormap(list(WIDTH_COLORS.values())),
              extent=(steps[0] - 0.5, steps[-1] + 0.5, len(rows) - 0.5, -0.5))
    row_axis(ax, [names[i] for i in rows])
    ax.set_xlabel("step (a width holds from the step that assigned it)")
    ax.legend(handles=[Patch(facecolor=c, edgecolor="#555555", label=f"{b} bits")
                       for b, c in WIDTH_COLORS.items()],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_title(f"STQuant optimizer-state widths · {len(rows)} layers · "
                 f"{len(history.steps)} assignments, steps {history.steps[0]}-"
                 f"{history.steps[-1]} · mean over layers at the end "
                 f"{history.bits[:, -1].mean():.1f} bits", fontsize=10)
    return fig
