"""The GaussWS figure of ``plot_precision.py gaussws``: the learned bit widths b_t of a run
(a small version of the GaussWS paper's Fig. 6).

One panel per sampled site kind (``proj``, ``fc2``, ...; ``--gaussws od`` samples those two):
for every layer a line, b_t's mean over the site's 32 x 32 tiles, and a band from the
smallest to the largest tile's b_t, over the logged training steps; colour from light (first
layer) to dark (last). The last panel is the paper's view at the end of the run: per site in
model order the mean (dot) and the min-max range (bar) at the last logged step. Read by
:func:`megatron_ext.methods.gaussws.history.load_bitwidths`.
"""

from __future__ import annotations

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from megatron_ext.sites import parse_site_id
from megatron_ext.viz.plots import new_figure


def _layer_colors(layers: list[int]) -> dict[int, tuple]:
    cmap = colormaps["viridis"]
    top = max(max(layers), 1)
    return {layer: cmap(0.85 * (1 - layer / top)) for layer in layers}


def _over_steps(ax, history, kind: str, colors: dict[int, tuple]) -> None:
    steps = np.array(history.steps)
    for row, sid in enumerate(history.sites):
        layer, site = parse_site_id(sid)
        if site != kind:
            continue
        color = colors[layer]
        ax.fill_between(steps, history.bits["min"][row], history.bits["max"][row],
                        color=color, alpha=0.2, linewidth=0)
        ax.plot(steps, history.bits["mean"][row], color=color, linewidth=1.2, label=f"L{layer}")
    ax.set_title(f"{kind}: mean, band = min-max over tiles", fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, frameon=False)


def _at_end(ax, history) -> None:
    mean, low, high = (history.final(stat) for stat in ("mean", "min", "max"))
    x = np.arange(len(history.sites))
    ax.errorbar(x, mean, yerr=[mean - low, high - mean], fmt="o", color="#c44e52",
                ecolor="#555555", capsize=3, markersize=4)
    ax.set_xticks(x, history.sites, rotation=90, fontsize=7)
    ax.set_title(f"step {history.steps[-1]}: mean, bar = min-max", fontsize=9)
    ax.grid(alpha=0.3)


def bitwidth_history(history) -> Figure:
    """The figure of the module docstring."""
    kinds = list(dict.fromkeys(parse_site_id(sid)[1] for sid in history.sites))
    colors = _layer_colors([parse_site_id(sid)[0] for sid in history.sites])
    fig = new_figure(3.6 * (len(kinds) + 1), 3.6)
    axes = fig.subplots(1, len(kinds) + 1, sharey=True)
    for ax, kind in zip(axes, kinds):
        _over_steps(ax, history, kind, colors)
    _at_end(axes[-1], history)
    axes[0].set_ylabel("b_t (bits)")
    fig.suptitle(f"GaussWS bit widths · {len(history.sites)} sampled sites · steps "
                 f"{history.steps[0]}-{history.steps[-1]} · mean over sites at the end "
                 f"{np.nanmean(history.final('mean')):.2f} bits", fontsize=10)
    return fig
