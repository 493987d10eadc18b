"""The learned bit widths of a ``--gaussws`` run, read back from its ``metrics.jsonl``.

Every logged step of such a run carries, per sampled site (``extension.on_step``)::

    {"step": 40, "loss": 6.1, "gaussws_b_mean/L0.proj": 7.93, "gaussws_b_min/L0.proj": 7.81,
     "gaussws_b_max/L0.proj": 8.02, ...}

b_t as the GEMMs use it (eq. 9, clamped by eq. 6), over the site's 32 x 32 tiles. A resumed
run appends the steps after its checkpoint again: the last record of a step wins. The plot
(``plot_precision.py gaussws``) and the plan hint (``tools/gaussws_hint.py``) read it here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from megatron_ext.io import read_jsonl
from megatron_ext.sites import SITES, parse_site_id

STATS = ("mean", "min", "max")
"""Per-site statistics a run logs, key ``gaussws_b_<stat>/<site id>``."""
PREFIX = "gaussws_b_"


@dataclass(frozen=True)
class BitWidthHistory:
    """b_t per site over the logged steps of one run."""

    path: str
    """The metrics file it was read from."""
    steps: tuple[int, ...]
    """Logged steps that carry b_t, ascending."""
    sites: tuple[str, ...]
    """Sampled site ids in model order (layer, then qkv, proj, fc1, fc2)."""
    bits: dict[str, np.ndarray]
    """``mean``, ``min``, ``max`` -> [site, step] b_t (NaN where a record lacks it)."""

    def final(self, stat: str) -> np.ndarray:
        """``stat`` of every site at the last step that has it (NaN if none does)."""
        values = self.bits[stat]
        out = np.full(len(self.sites), np.nan)
        for row, series in enumerate(values):
            finite = np.flatnonzero(np.isfinite(series))
            if finite.size:
                out[row] = series[finite[-1]]
        return out


def metrics_path(source: str) -> str:
    """``source/metrics.jsonl`` for a run directory, else ``source`` itself; a one-line
    ``ValueError`` when neither exists."""
    path = os.path.join(source, "metrics.jsonl") if os.path.isdir(source) else source
    if not os.path.isfile(path):
        what = "has no metrics.jsonl" if os.path.isdir(source) else "does not exist"
        raise ValueError(f"'{source}' {what} (need a run directory or its metrics.jsonl)")
    return path


def _site_of(key: str) -> tuple[str, str] | None:
    """``gaussws_b_min/L3.fc2`` -> ``("min", "L3.fc2")``; None for another key."""
    if not key.startswith(PREFIX):
        return None
    stat, _, sid = key[len(PREFIX):].partition("/")
    return (stat, sid) if stat in STATS else None


def _model_order(sid: str) -> tuple[int, int]:
    layer, site = parse_site_id(sid)
    return layer, SITES.index(site)


def load_bitwidths(source: str) -> BitWidthHistory:
    """A run directory's (or metrics file's) b_t records; ``ValueError`` with one line when
    there are none (not a ``--gaussws`` run) or a key names no site."""
    path = metrics_path(source)
    by_step: dict[int, dict[tuple[str, str], float]] = {}
    for record in read_jsonl(path):
        step = record.get("step")
        values = {}
        for key, value in record.items():
            parsed = _site_of(key)
            if parsed is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"'{path}' step {step}: {key} is not a number: {value!r}")
            values[parsed] = float(value) if math.isfinite(value) else math.nan
        if values and isinstance(step, int) and not isinstance(step, bool):
            by_step[step] = values
    if not by_step:
        raise ValueError(f"'{path}' has no {PREFIX}{{mean,min,max}}/<site> records "
                         "(not a --gaussws run?)")
    try:
        sites = sorted({sid for v in by_step.values() for _, sid in v}, key=_model_order)
    except ValueError as exc:
        raise ValueError(f"'{path}': {exc}") from None
    steps = tuple(sorted(by_step))
    bits = {stat: np.array([[by_step[t].get((stat, sid), np.nan) for t in steps]
                            for sid in sites]) for stat in STATS}
    return BitWidthHistory(path, steps, tuple(sites), bits)
