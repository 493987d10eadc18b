"""Reading what the plots show: plans, a run's plan refreshes, divergence files, metrics.

Every reader raises ``ValueError`` with one line naming the file and the problem; the command
line turns it into ``error: ...`` and exit status 2. Files written by a run:

* ``RUN/snip/step_000100/plan.json`` — the PrecisionPlan made at a refresh (``"step"`` inside);
* ``RUN/snip/step_000100/divergence.json`` — per site and candidate option, SNIP's estimates::

      {"version": 1, "step": 100, "options": ["x=fp8_e4m3@tile128,w=...,dy=...", ...],
       "sites": {"L0.qkv": {"<option>": {"dL": 1e-4, "dW": 3e-5, "q": 2e-4}, ...}, ...}}

* ``RUN/metrics.jsonl`` — one JSON object per line: train records with ``"loss"``, validation
  records with ``"val_loss"``, both with ``"step"`` (``megatron_ext.training.metrics``);
* ``RUN/gnmr/trace.jsonl`` — one GNMR decision per line (``docs/gnmr.md``)::

      {"step": 12, "alpha": 2.0, "beta": 1.5, "units": {"L0": {"norm": 0.41, "agnm": 0.37,
       "gnmr": 1.12, "dgnmr": 1.05, "high": true, "lock": 10}, ...}}

  (``null`` for a non-finite number; a skipped step has ``"nonfinite": true`` and no
  thresholds);
* ``RUN/stquant_widths.jsonl`` — every width assignment of ``--optimizer stquant-adamw``
  (``docs/stquant.md``)::

      {"step": 10, "widths": {"decoder.layers.mlp.linear_fc1.weight[3]": 4, ...}}
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass

import numpy as np

from megatron_ext.io import read_json, read_jsonl
from megatron_ext.sites import parse_site_id

PLAN_GLOB = os.path.join("snip", "step_*", "plan.json")
"""Where a run's planner writes the plan of each refresh, relative to the run directory."""
METRICS = ("dL", "dW", "q")
"""Per-option values of divergence.json: forward loss divergence, weight divergence, quality."""


# ---------------------------------------------------------------------------------- plans


def load_plan(path: str):
    """A PrecisionPlan file (``megatron_ext.precision.plan.load_plan``)."""
    from megatron_ext.precision.plan import load_plan as _load

    return _load(path)


def plan_files(source: str) -> list[str]:
    """``source`` itself if it is a file, else its ``snip/step_*/plan.json`` files."""
    if not os.path.isdir(source):
        return [source]
    files = sorted(glob.glob(os.path.join(source, PLAN_GLOB)))
    if not files:
        raise ValueError(f"'{source}' has no {PLAN_GLOB} (not a run directory with SNIP "
                         "refreshes, and not a plan file)")
    return files


def load_plan_series(sources: list[str]) -> list:
    """The plans of every source (run directories and plan files), in step order; two plans
    of the same step are an error."""
    plans = {}
    for path in (f for source in sources for f in plan_files(source)):
        plan = load_plan(path)
        if plan.step in plans:
            raise ValueError(f"two plans for step {plan.step}: '{plans[plan.step][0]}' and "
                             f"'{path}'")
        plans[plan.step] = (path, plan)
    return [plans[step][1] for step in sorted(plans)]


def num_layers_of(plan) -> int:
    """Layers a plan mentions: its highest layer index + 1 (0 for an empty plan)."""
    return 1 + max((parse_site_id(sid)[0] for sid in plan.sites), default=-1)


def model_shape(family: str, preset: str, num_layers: int | None, pipeline_stages: int,
                layers_per_virtual_stage: int | None = None):
    """The cost model's ``ModelShape`` of a ``--model`` preset (tokens = 1: fractions do not
    depend on them); ``ValueError`` for an unknown preset or a layout that does not divide."""
    from megatron_ext.precision.cost import ModelShape
    from megatron_ext.training.presets import get_preset

    arch = get_preset(family, preset)
    layers = num_layers or arch.num_layers
    if pipeline_stages < 1 or layers % pipeline_stages:
        raise ValueError(f"--pipeline-model-parallel-size {pipeline_stages} does not divide "
                         f"the {layers} layers")
    per_stage = layers // pipeline_stages
    if layers_per_virtual_stage is not None and (layers_per_virtual_stage < 1
                                                 or per_stage % layers_per_virtual_stage):
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} "
                         f"does not divide the {per_stage} layers of a stage")
    return ModelShape(layers, arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads,
                      arch.num_query_groups, arch.swiglu, 1, pipeline_stages,
                      layers_per_virtual_stage)


# ----------------------------------------------------------------------------- divergence


@dataclass(frozen=True)
class Divergence:
    """One refresh's divergence.json."""

    step: int
    """Training step of the refresh."""
    options: tuple[str, ...]
    """Candidate option names, in the file's order."""
    sites: dict[str, dict[str, dict[str, float | None]]]
    """Site id -> option name -> ``{"dL", "dW", "q"}`` (``None`` where the file has none)."""

    def value(self, site: str, option: str, metric: str) -> float | None:
        """``metric`` of ``option`` at ``site``; ``None`` if the file does not give it."""
        return self.sites.get(site, {}).get(option, {}).get(metric)


def _number(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _site_values(sid: str, entry, path: str) -> dict[str, dict[str, float | None]]:
    try:
        parse_site_id(sid)
    except ValueError as exc:
        raise ValueError(f"'{path}': {exc}") from None
    if not isinstance(entry, dict):
        raise ValueError(f"'{path}': sites.{sid} must be an object: option -> values")
    out = {}
    for option, values in entry.items():
        where = f"'{path}': sites.{sid}[{option!r}]"
        if not isinstance(values, dict):
            raise ValueError(f"{where} must be an object with {', '.join(METRICS)}")
        out[option] = {m: _number(values.get(m), f"{where}.{m}") for m in METRICS}
    return out


def load_divergence(path: str) -> Divergence:
    """Read and check a divergence.json (schema in the module docstring)."""
    data = read_json(path)
    if not isinstance(data, dict) or data.get("version") != 1:
        raise ValueError(f"'{path}' is not a version-1 divergence file (need \"version\": 1)")
    options, sites = data.get("options"), data.get("sites")
    if (not isinstance(options, list) or not options
            or not all(isinstance(o, str) for o in options)):
        raise ValueError(f"'{path}': \"options\" must be a non-empty list of option names")
    if not isinstance(sites, dict) or not sites:
        raise ValueError(f"'{path}': \"sites\" must be a non-empty object: site -> options")
    step = data.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"'{path}': \"step\" must be an integer")
    parsed = {sid: _site_values(sid, entry, path) for sid, entry in sites.items()}
    return Divergence(step, tuple(options), parsed)


def _is_fp4(name: str) -> bool:
    """The cost model's FP4 class (at most 4 bits: E2M1, MXFP4, NVFP4, INT4); a name the
    format registry does not know counts when it says ``fp4``."""
    from megatron_ext.precision.cost import operand_class
    from megatron_ext.precision.site_formats import normalize_format

    try:
        return operand_class(normalize_format(name)) == "fp4"
    except ValueError:
        return "fp4" in name.lower()


def fp4_roles(option: str) -> int:
    """How many roles an option name (``x=fp4_e2m1@tile128,w=nvfp4,dy=fp8_e4m3@tile128``,
    as the SNIP planner writes them) puts in FP4: 2 here. A name that is not ``role=format``
    pairs counts its ``fp4`` occurrences."""
    pairs = [part.partition("=") for part in option.split(",")]
    if all(sep for _, sep, _ in pairs):
        return sum(_is_fp4(fmt.strip()) for _, _, fmt in pairs)
    return option.lower().count("fp4")


def default_option(options) -> str:
    """The option with the most FP4 roles (the all-FP4 one), the first of equals."""
    return max(options, key=fp4_roles)


# -------------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class LossCurve:
    """Loss records of one run (the last record of a step wins: a resumed run appends)."""

    label: str
    """Legend label."""
    train: tuple[tuple[int, float], ...]
    """(step, training loss), in step order."""
    val: tuple[tuple[int, float], ...]
    """(step, validation loss), in step order."""


def metrics_file(source: str) -> str:
    """``source/metrics.jsonl`` for a run directory, else ``source`` itself."""
    return os.path.join(source, "metrics.jsonl") if os.path.isdir(source) else source


def _series(records: list[dict], key: str) -> tuple[tuple[int, float], ...]:
    by_step = {}
    for record in records:
        value, step = record.get(key), record.get("step")
        if isinstance(value, (int, float)) and isinstance(step, int) and math.isfinite(value):
            by_step[step] = float(value)
    return tuple(sorted(by_step.items()))


def load_loss_curve(source: str, label: str | None = None) -> LossCurve:
    """Train and validation losses of one run directory (or metrics.jsonl file)."""
    path = metrics_file(source)
    records = read_jsonl(path)
    curve = LossCurve(label or _default_label(source), _series(records, "loss"),
                      _series(records, "val_loss"))
    if not curve.train and not curve.val:
        raise ValueError(f"'{path}' has no \"loss\" or \"val_loss\" records")
    return curve


def _default_label(source: str) -> str:
    path = os.path.normpath(source)
    if os.path.basename(path) == "metrics.jsonl":
        path = os.path.dirname(path) or path
    return os.path.basename(path)


# ---------------------------------------------------------------------------- GNMR trace

TRACE = os.path.join("gnmr", "trace.jsonl")
"""Where a ``--gnmr`` run writes its trace, relative to the run directory."""
TRACE_VALUES = ("norm", "gnmr", "dgnmr")
"""Per-unit numbers of a trace line that :class:`GnmrTrace` keeps."""


@dataclass(frozen=True)
class GnmrTrace:
    """A run's GNMR trace, one column per step (the last line of a step wins: a resumed run
    appends the steps after its checkpoint again)."""

    steps: tuple[int, ...]
    """Training steps, ascending."""
    units: tuple[str, ...]
    """Unit ids (``L3`` or ``L3.fc1``), in the trace's order."""
    values: dict[str, np.ndarray]
    """``norm``, ``gnmr``, ``dgnmr`` -> [unit, step] floats (NaN where the trace has null)."""
    high: np.ndarray
    """[unit, step]: the unit runs the *next* step in high precision."""
    alpha: np.ndarray
    """α_t per step (NaN on a skipped, non-finite step)."""
    beta: np.ndarray
    """β_t per step (NaN on a skipped step)."""
    nonfinite: tuple[int, ...]
    """Steps that were skipped (non-finite loss or gradients)."""
    compare: str
    """``ratio`` or ``excess``: the run's ``--gnmr-compare`` (from its args.json; ratio if
    there is none)."""


def _trace_line(record: dict, path: str, units) -> tuple[int, dict]:
    step, entries = record.get("step"), record.get("units")
    if (isinstance(step, bool) or not isinstance(step, int) or not isinstance(entries, dict)
            or not entries or (units is not None and list(entries) != list(units))):
        raise ValueError(f"'{path}': step {step!r} is not a GNMR trace line of the same units "
                         f"(need \"step\" and \"units\")")
    for unit, entry in entries.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("high"), bool):
            raise ValueError(f"'{path}': step {step}, unit {unit}: need an object with "
                             f"\"high\": true/false")
    return step, entries


def _run_compare(path: str) -> str:
    args = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "args.json")
    if not os.path.isfile(args):
        return "ratio"
    return read_json(args).get("gnmr_compare") or "ratio"


def load_gnmr_trace(source: str) -> GnmrTrace:
    """A run directory's ``gnmr/trace.jsonl`` (or that file) as a :class:`GnmrTrace`."""
    path = os.path.join(source, TRACE) if os.path.isdir(source) else source
    lines, units = {}, None
    for record in read_jsonl(path):
        step, entries = _trace_line(record, path, units)
        units = units or tuple(entries)
        lines[step] = record
    if not lines:
        raise ValueError(f"'{path}' has no GNMR trace lines")
    steps = tuple(sorted(lines))

    def grid(key):
        return np.array([[_number(lines[t]["units"][u].get(key), f"'{path}' step {t} {u}.{key}")
                          for t in steps] for u in units], dtype=float)

    header = {key: np.array([_number(lines[t].get(key), f"'{path}' step {t} {key}")
                             for t in steps], dtype=float) for key in ("alpha", "beta")}
    high = np.array([[lines[t]["units"][u]["high"] for t in steps] for u in units])
    nonfinite = tuple(t for t in steps if lines[t].get("nonfinite"))
    return GnmrTrace(steps, units, {key: grid(key) for key in TRACE_VALUES}, high,
                     header["alpha"], header["beta"], nonfinite, _run_compare(path))


# -------------------------------------------------------------------------- STQuant widths

WIDTHS_FILE = "stquant_widths.jsonl"
"""Where ``--optimizer stquant-adamw`` writes its width assignments, in the run directory."""


@dataclass(frozen=True)
class WidthHistory:
    """STQuant's widths per layer at every assignment (a later line of a step wins)."""

    steps: tuple[int, ...]
    """Steps that assigned widths, ascending."""
    layers: tuple[str, ...]
    """Layer names as the run wrote them."""
    bits: np.ndarray
    """[layer, assignment] widths."""


def load_widths(source: str) -> WidthHistory:
    """A run directory's ``stquant_widths.jsonl`` (or that file) as a :class:`WidthHistory`."""
    path = os.path.join(source, WIDTHS_FILE) if os.path.isdir(source) else source
    lines = {}
    for record in read_jsonl(path):
        step, widths = record.get("step"), record.get("widths")
        if (isinstance(step, bool) or not isinstance(step, int) or not isinstance(widths, dict)
                or not widths or any(b not in (4, 8, 16, 32) for b in widths.values())):
            raise ValueError(f"'{path}': {str(record)[:60]} is not a width line (need \"step\" "
                             "and \"widths\": {layer: 4|8|16|32})")
        lines[step] = widths
    if not lines:
        raise ValueError(f"'{path}' has no width lines")
    steps = tuple(sorted(lines))
    layers = tuple(lines[steps[0]])
    if any(set(lines[t]) != set(layers) for t in steps):
        raise ValueError(f"'{path}': the lines do not name the same layers")
    bits = np.array([[lines[t][name] for t in steps] for name in layers])
    return WidthHistory(steps, layers, bits)

