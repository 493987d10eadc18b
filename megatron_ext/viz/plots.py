"""The figures of ``tools/plot_precision.py``: matplotlib, Agg canvas, PNG files.

Figures are built on a ``matplotlib.figure.Figure`` with its own Agg canvas (never
``pyplot``: no global backend or figure state, no display needed) and written by
:func:`save_png` to a temporary file renamed into place, so a PNG is either whole or absent.

* :func:`plan_heatmap` — layer x (site, role), colour = format family;
* :func:`stage_bars` — FP4 / FP8 / BF16 share of each pipeline stage's linear FLOPs;
* :func:`plan_evolution` — a plan over refreshes (SNIP Fig. 11): step x site, colour = how many
  of the site's roles are FP4, or step x (site, role) with colour = format family;
* :func:`divergence_heatmap` — layer x site, colour = log10 of an option's ΔL, ΔW or Q
  (Fig. 10);
* :func:`loss_curves` — training and validation loss of several runs on one axis (Fig. 8).
"""

from __future__ import annotations

import math
import textwrap

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from megatron_ext.io import write_atomic
from megatron_ext.sites import ROLES, SITES
from megatron_ext.viz.colors import CLASS_COLORS, family_color, format_family, legend_order

METRIC_LABELS = {"dL": "ΔL (forward loss divergence)", "dW": "ΔW (weight divergence)",
                 "q": "Q (quality loss)"}
"""Axis labels of the divergence metrics."""
FP4_ROLE_COLORS = ("#e3e3e3", "#f4a582", "#d6604d", "#8b1a1a")
"""Colours of 0, 1, 2, 3 FP4 roles in a site."""
MAX_TICKS = 24
"""At most this many labelled ticks on an axis of layers, sites or steps."""


def new_figure(width: float, height: float) -> Figure:
    """A figure with its own Agg canvas (inches)."""
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: str, dpi: int = 100) -> None:
    """Write ``fig`` as a PNG atomically."""
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=dpi, bbox_inches="tight"),
                 binary=True)


def _thin_ticks(count: int) -> list[int]:
    """Tick positions 0..count-1, at most :data:`MAX_TICKS` of them."""
    return list(range(0, count, max(1, math.ceil(count / MAX_TICKS))))


def _family_legend(ax, families) -> None:
    handles = [Patch(facecolor=family_color(f), edgecolor="#555555", label=f)
               for f in legend_order(families)]
    ax.legend(handles=handles, title="format", loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False)


def _rgb_grid(families: list[list[str]]) -> np.ndarray:
    return np.array([[to_rgb(family_color(f)) for f in row] for row in families])


def _plan_title(plan) -> str:
    return f"precision plan {plan.method} · step {plan.step} · {plan.hash[:12]}"


# ------------------------------------------------------------------------------ plan heatmap


def _role_families(plan, layer: int) -> list[str]:
    """The 12 families of one layer: site by site, x / w / dy."""
    return [format_family(getattr(plan.formats(f"L{layer}.{site}"), role))
            for site in SITES for role in ROLES]


def _mark_overrides(ax, plan, layers: int) -> None:
    """A dot in each (layer, site, role) cell that a per-GEMM override changes somewhere."""
    for layer in range(layers):
        for s, site in enumerate(SITES):
            for operand, _ in plan.formats(f"L{layer}.{site}").overrides:
                col = 3 * s + ROLES.index(operand.split(".")[1])
                ax.plot(col, layer, marker="o", markersize=3, color="white",
                        markeredgecolor="black", markeredgewidth=0.5)


def _site_axes(ax, layers: int) -> None:
    """Role ticks below, site names above, white lines between sites."""
    ax.set_xticks(range(3 * len(SITES)), [*ROLES] * len(SITES))
    top = ax.secondary_xaxis("top")
    top.set_xticks([3 * s + 1 for s in range(len(SITES))], SITES)
    top.tick_params(length=0)
    for s in range(1, len(SITES)):
        ax.axvline(3 * s - 0.5, color="white", linewidth=3)
    ax.set_yticks(_thin_ticks(layers))
    ax.set_ylabel("layer")


def plan_heatmap(plan, num_layers: int) -> Figure:
    """Layer (rows) x site / role (columns) of ``plan``, coloured by format family."""
    families = [_role_families(plan, layer) for layer in range(num_layers)]
    fig = new_figure(7.0, min(2.0 + 0.28 * num_layers, 16.0))
    ax = fig.add_subplot()
    ax.imshow(_rgb_grid(families), aspect="auto", interpolation="nearest")
    _site_axes(ax, num_layers)
    if num_layers <= 64:
        for layer in range(1, num_layers):
            ax.axhline(layer - 0.5, color="white", linewidth=0.5)
    _mark_overrides(ax, plan, num_layers)
    _family_legend(ax, {f for row in families for f in row})
    ax.set_title(_plan_title(plan), pad=22)
    return fig


# -------------------------------------------------------------------------------- stage bars


def _stacked_bar(ax, x: int, fractions: dict[str, float]) -> None:
    bottom = 0.0
    for cls in ("fp4", "fp8", "bf16"):
        height = fractions[cls]
        ax.bar(x, height, bottom=bottom, color=CLASS_COLORS[cls], edgecolor="white", width=0.7)
        if height >= 0.05:
            ax.text(x, bottom + height / 2, f"{100 * height:.0f}%", ha="center", va="center",
                    fontsize=8, color="white")
        bottom += height


def stage_bars(report, title: str) -> Figure:
    """FP4 / FP8 / BF16 fractions of every pipeline stage's linear FLOPs, and of all of them
    (``report``: ``megatron_ext.precision.cost.FlopReport``)."""
    groups = [*report.stage_fractions, report.fractions]
    labels = [f"stage {k}" for k in range(len(report.stage_fractions))] + ["all"]
    fig = new_figure(max(4.0, 1.0 + 0.7 * len(groups)), 4.0)
    ax = fig.add_subplot()
    for x, fractions in enumerate(groups):
        _stacked_bar(ax, x, fractions)
    ax.axvline(len(groups) - 1.5, color="#999999", linewidth=0.8, linestyle=":")
    ax.set_xticks(range(len(groups)), labels, rotation=45 if len(groups) > 10 else 0)
    ax.set_ylim(0, 1)
    ax.set_ylabel("fraction of linear-layer FLOPs")
    handles = [Patch(facecolor=CLASS_COLORS[c], label=c.upper()) for c in ("fp4", "fp8", "bf16")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(f"{title}\nest. GEMM time {report.time_vs_bf16:.2f}x BF16", fontsize=10)
    return fig


# ----------------------------------------------------------------------------- evolution


def _site_rows(plans) -> list[str]:
    """Every site any plan lists, in layer then site order."""
    from megatron_ext.sites import parse_site_id

    def order(sid):
        layer, site = parse_site_id(sid)
        return layer, SITES.index(site)

    return sorted({sid for plan in plans for sid in plan.sites}, key=order)


def _fp4_role_count(formats) -> int:
    from megatron_ext.precision.cost import operand_class

    return sum(operand_class(getattr(formats, role)) == "fp4" for role in ROLES)


def _step_axis(ax, plans) -> None:
    ticks = _thin_ticks(len(plans))
    ax.set_xticks(ticks, [str(plans[i].step) for i in ticks],
                  rotation=90 if len(plans) > 12 else 0)
    ax.set_xlabel("refresh step")


def row_axis(ax, rows: list[str]) -> None:
    """Label every row (``L3.fc1`` or ``L3.fc1.dy``) when there are few, else the first row of
    every k-th layer (``L3``); lines between layers."""
    layers = [row.split(".")[0] for row in rows]
    starts = [i for i, layer in enumerate(layers) if i == 0 or layer != layers[i - 1]]
    if len(rows) <= 2 * MAX_TICKS:
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
    else:
        shown = starts[::max(1, math.ceil(len(starts) / MAX_TICKS))]
        ax.set_yticks(shown, [layers[i] for i in shown], fontsize=8)
    if len(starts) <= 64:
        for start in starts[1:]:
            ax.axhline(start - 0.5, color="white", linewidth=1.0)


def _evolution_fp4(fig, ax, plans, sites) -> None:
    counts = np.array([[_fp4_role_count(plan.formats(sid)) for plan in plans] for sid in sites])
    image = ax.imshow(counts, aspect="auto", interpolation="nearest", vmin=-0.5, vmax=3.5,
                      cmap=ListedColormap(FP4_ROLE_COLORS))
    bar = fig.colorbar(image, ax=ax, ticks=range(4), fraction=0.05)
    bar.set_label("FP4 roles of x, w, dy")
    row_axis(ax, sites)


def _evolution_formats(ax, plans, sites) -> None:
    rows = [(sid, role) for sid in sites for role in ROLES]
    families = [[format_family(getattr(plan.formats(sid), role)) for plan in plans]
                for sid, role in rows]
    ax.imshow(_rgb_grid(families), aspect="auto", interpolation="nearest")
    row_axis(ax, [f"{sid}.{role}" for sid, role in rows])
    _family_legend(ax, {f for row in families for f in row})


def plan_evolution(plans, color_by: str = "fp4-roles") -> Figure:
    """Plans of successive refreshes side by side: refresh step (x) x site (y)."""
    sites = _site_rows(plans)
    if not sites:
        raise ValueError("the plans list no sites")
    rows = len(sites) * (3 if color_by == "format" else 1)
    fig = new_figure(min(3.5 + 0.35 * len(plans), 16.0), min(2.0 + 0.16 * rows, 16.0))
    ax = fig.add_subplot()
    if color_by == "format":
        _evolution_formats(ax, plans, sites)
    else:
        _evolution_fp4(fig, ax, plans, sites)
    _step_axis(ax, plans)
    ax.set_title(f"precision plan over {len(plans)} refresh(es) · {plans[-1].method}")
    return fig


# ---------------------------------------------------------------------------- divergence


def _divergence_grid(div, option: str, metric: str) -> tuple[np.ndarray, int]:
    """(log10 values [layers, 4], NaN where missing or <= 0; count of values <= 0)."""
    from megatron_ext.sites import parse_site_id

    layers = 1 + max(parse_site_id(sid)[0] for sid in div.sites)
    grid = np.full((layers, len(SITES)), np.nan)
    non_positive = 0
    for sid in div.sites:
        layer, site = parse_site_id(sid)
        value = div.value(sid, option, metric)
        if value is not None and value > 0:
            grid[layer, SITES.index(site)] = math.log10(value)
        elif value is not None:
            non_positive += 1
    return grid, non_positive


def _annotate_cells(ax, grid: np.ndarray) -> None:
    for (row, col), value in np.ndenumerate(grid):
        if not np.isnan(value):
            ax.text(col, row, f"{value:.1f}", ha="center", va="center", fontsize=7,
                    color="white" if value < np.nanmean(grid) else "black")


def divergence_heatmap(div, option: str, metric: str) -> Figure:
    """Layer x site, colour = log10 of ``metric`` of ``option`` (grey: missing or <= 0)."""
    grid, non_positive = _divergence_grid(div, option, metric)
    if np.isnan(grid).all():
        raise ValueError(f"no positive {metric} value for option {option!r} at any site")
    fig = new_figure(6.5, min(2.5 + 0.3 * grid.shape[0], 16.0))
    ax = fig.add_subplot()
    cmap = colormaps["viridis"].with_extremes(bad="#d9d9d9")
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest",
                      cmap=cmap)
    fig.colorbar(image, ax=ax, fraction=0.05).set_label(f"log10 {METRIC_LABELS[metric]}")
    if grid.size <= 128:
        _annotate_cells(ax, grid)
    ax.set_xticks(range(len(SITES)), SITES)
    ax.set_yticks(_thin_ticks(grid.shape[0]))
    ax.set_ylabel("layer")
    missing = int(np.isnan(grid).sum()) - non_positive
    note = "".join([f" · grey: {missing} missing" if missing else "",
                    f" · grey: {non_positive} <= 0" if non_positive else ""])
    wrapped = "\n".join(textwrap.wrap(option, 70))
    ax.set_title(f"step {div.step} · {METRIC_LABELS[metric]}{note}\n{wrapped}", fontsize=9)
    return fig


# ---------------------------------------------------------------------------------- loss


def _savgol_weights(m: int) -> np.ndarray:
    """Weights of the centre value of a least-squares quadratic through 2m + 1 equally spaced
    points (Savitzky-Golay): 3 (3m² + 3m - 1 - 5k²) / ((2m - 1)(2m + 1)(2m + 3)), k = -m..m."""
    if m == 0:
        return np.ones(1)
    k = np.arange(-m, m + 1)
    return 3 * (3 * m * m + 3 * m - 1 - 5 * k * k) / ((2 * m - 1) * (2 * m + 1) * (2 * m + 3))


def _smoothed(values: list[float], window: int) -> list[float]:
    """Centred smoothing: record ``i`` is the value at ``i`` of a quadratic fitted to it and
    the ``window // 2`` records on each side (fewer near the ends, as many on both sides).
    Centred, it does not delay a trend (a trailing mean lags by ``(window - 1) / 2`` records);
    quadratic, it follows the bend of a falling loss, which a centred mean lifts."""
    data, last = np.asarray(values, dtype=float), len(values) - 1
    half = [min(window // 2, i, last - i) for i in range(len(values))]
    return [float(data[i - h:i + h + 1] @ _savgol_weights(h)) for i, h in enumerate(half)]


def _from(points, from_step: int) -> list[tuple]:
    return [(step, value) for step, value in points if step >= from_step]


def loss_curves(curves, smooth: int = 1, from_step: int = 0) -> Figure:
    """Training loss (lines) and validation loss (dashed, dots) of several runs, one axis;
    only steps >= ``from_step`` (the centred means still use the records before it)."""
    fig = new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    for index, curve in enumerate(curves):
        color = f"C{index % 10}"
        if curve.train:
            steps, losses = zip(*curve.train)
            train = _from(zip(steps, _smoothed(list(losses), smooth)), from_step)
            if train:
                ax.plot(*zip(*train), color=color, linewidth=1.2, label=f"{curve.label} train")
        val = _from(curve.val or [], from_step)
        if val:
            ax.plot(*zip(*val), color=color, linestyle="--", marker="o", markersize=3,
                    linewidth=1.0, label=f"{curve.label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    smoothing = (f" (train: centred quadratic fit over {2 * (smooth // 2) + 1} records)"
                 if smooth > 1 else "")
    start = f", steps >= {from_step}" if from_step else ""
    ax.set_title(f"loss{smoothing}{start}")
    return fig
