"""SNIP steps 4-5 offline: a refresh's saved statistics -> quality table -> ILP problem.

Every refresh of a ``--precision snip`` run (or a §6.1 statistics baseline) writes
``<run>/snip/step_<s>/stats.json`` — the reduced statistics of every site (``sites``: a list
of :class:`~megatron_ext.methods.snip.divergence.SiteStats` dicts), the loss, the AdamW
hyper-parameters (``adam``) and the candidate formats per role (``candidates``) — and the run
writes its flags to ``<run>/args.json``. From those two files this module rebuilds the
refresh's ``problem.json`` with the same functions the run uses
(:func:`megatron_ext.methods.snip.planner.quality_table`, :func:`~megatron_ext.precision.cost.
stage_fixed_seconds`, :func:`~megatron_ext.methods.snip.planner.build_problem`), so that
``tools/snip_analyze.py --stats`` and ``tools/tune_precision.py`` can re-plan for another
budget, policy or **pipeline layout** (a what-if: the statistics do not depend on it).

Layout overrides follow Megatron-LM: ``--pipeline-model-parallel-size P`` splits the layers
evenly; ``--decoder-first-pipeline-num-layers N`` / ``--decoder-last-pipeline-num-layers N``
give the first / last stage ``N`` layers and split the rest evenly over the other stages
(megatron-core ``TransformerConfig``: each ``N`` >= 1, the rest must divide evenly, and
with ``P = 2`` and both given they must add up to the layer count). An overridden layout
has no virtual (interleaved) stages. Bad input is a one-line ``ValueError``.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from megatron_ext.precision.cost import ModelShape, stage_fixed_seconds
from megatron_ext.precision.device_profile import DeviceProfile
from megatron_ext.sites import parse_site_id
from megatron_ext.precision.random_draw import draw_seed
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.methods.snip import planner
from megatron_ext.methods.snip.divergence import SiteStats
from megatron_ext.methods.snip.candidates import Candidates
from megatron_ext.io import read_json
from megatron_ext.methods.snip.problem import Problem
from megatron_ext.methods.snip.stats import PER_FORMAT, SCALARS

STATS_FILE = "stats.json"
"""A refresh's statistics, in ``<run>/snip/step_<s>/``."""
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STATS_KEYS = ("sites", "loss", "adam", "candidates")


@dataclass(frozen=True)
class Refresh:
    """One refresh's saved statistics and the flags of the run that made them."""

    stats_path: str
    """The stats.json read."""
    args_path: str
    """The args.json read."""
    step: int
    """Training step of the refresh."""
    sites: list[SiteStats]
    """Reduced statistics per site, in the run's site order."""
    loss: float
    """Loss of the statistics batch (ΔL is relative to it)."""
    hyper: dict
    """AdamW hyper-parameters at the refresh (lr, beta1, beta2, eps, step)."""
    candidates: Candidates
    """Candidate formats per role."""
    run_args: dict
    """The run's flags (args.json)."""

    @property
    def options(self) -> list[SiteFormats]:
        """The options every site chooses among, in the run's order."""
        return self.candidates.options()


@dataclass(frozen=True)
class Layout:
    """Pipeline-layout overrides; None keeps the run's."""

    pipeline: int | None = None
    """``--pipeline-model-parallel-size``."""
    first: int | None = None
    """``--decoder-first-pipeline-num-layers``."""
    last: int | None = None
    """``--decoder-last-pipeline-num-layers``."""

    @property
    def overridden(self) -> bool:
        return any(v is not None for v in (self.pipeline, self.first, self.last))


@dataclass(frozen=True)
class Planning:
    """A refresh turned into an ILP instance for one policy and layout."""

    refresh: Refresh
    policy: str
    """Quality table used (:data:`megatron_ext.methods.snip.planner.STATS_POLICIES`)."""
    problem: Problem
    """The ILP instance (what the run writes as problem.json)."""
    args: argparse.Namespace
    """The run's flags with the layout applied."""
    shape: ModelShape
    layer_stage: list[int]
    """Pipeline stage of every layer."""
    weights: tuple[float, float]
    """(w_L, w_W) of Q = w_L ΔL + w_W ΔW: the run's ``--snip-loss-weight`` and
    ``--snip-weight-weight``."""

    @property
    def options(self) -> list[SiteFormats]:
        return self.refresh.options


# ---------------------------------------------------------------- reading


def find_stats(path: str) -> str:
    """``path`` itself if a file; in a refresh directory its stats.json; in a run directory
    the stats.json of its latest refresh (``snip/step_*``)."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise ValueError(f"cannot read {path}: no such file or directory")
    if os.path.isfile(os.path.join(path, STATS_FILE)):
        return os.path.join(path, STATS_FILE)
    snip = os.path.join(path, "snip")
    steps = [(int(m.group(1)), name) for name in _listdir(snip)
             if (m := _STEP_DIR.match(name))
             and os.path.isfile(os.path.join(snip, name, STATS_FILE))]
    if not steps:
        raise ValueError(f"{path}: no snip/step_*/{STATS_FILE} (not a SNIP run directory)")
    return os.path.join(snip, max(steps)[1], STATS_FILE)


def _listdir(path: str) -> list[str]:
    return os.listdir(path) if os.path.isdir(path) else []


def default_args_path(stats_path: str) -> str:
    """``<run>/args.json`` for ``<run>/snip/step_<s>/stats.json``."""
    run = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(stats_path))))
    return os.path.join(run, "args.json")


def load_refresh(path: str, args_path: str | None = None) -> Refresh:
    """Read a refresh (``path``: stats.json, a refresh or a run directory) and its run's
    args.json (default: next to the run)."""
    stats_path = find_stats(path)
    data = read_json(stats_path)
    missing = [k for k in _STATS_KEYS if k not in data]
    if missing:
        raise ValueError(f"{stats_path}: not a SNIP stats.json (missing key {missing[0]!r})")
    args_path = args_path or default_args_path(stats_path)
    if not os.path.isfile(args_path):
        raise ValueError(f"{stats_path}: no args.json at {args_path}; give --args")
    run_args = read_json(args_path)
    return Refresh(stats_path, args_path, int(data.get("step", 0)),
                   _site_stats(data["sites"], stats_path), float(data["loss"]),
                   dict(data["adam"]), _candidates(data["candidates"], stats_path), run_args)


def _site_stats(sites, where: str) -> list[SiteStats]:
    if not isinstance(sites, list) or not sites:
        raise ValueError(f"{where}: 'sites' must be a non-empty list")
    try:
        out = [SiteStats(**s) for s in sites]
    except TypeError as err:
        raise ValueError(f"{where}: malformed site statistics ({err})") from None
    for site in out:
        missing = [k for k in (*SCALARS, *PER_FORMAT) if k not in site.stats]
        if missing:
            raise ValueError(f"{where}: site {site.site} has no statistic {missing[0]!r} "
                             "(written by an older megatron_ext? re-run the refresh)")
    return out


def _candidates(per_role, where: str) -> Candidates:
    roles = ("x", "w", "dy")
    if not isinstance(per_role, dict) or any(not per_role.get(r) for r in roles):
        raise ValueError(f"{where}: 'candidates' must list formats for x, w and dy")
    return Candidates({r: tuple(per_role[r]) for r in roles})


# ---------------------------------------------------------------- layout


def layers_per_stage(num_layers: int, stages: int, first: int | None = None,
                     last: int | None = None) -> list[int]:
    """Layers on each pipeline stage, megatron-core's (uneven) split (module docstring)."""
    if stages < 1:
        raise ValueError(f"pipeline size must be >= 1, got {stages}")
    if first is None and last is None:
        if num_layers % stages:
            raise ValueError(f"{num_layers} layers do not split evenly into {stages} "
                             "pipeline stages")
        return [num_layers // stages] * stages
    if stages < 2:
        raise ValueError("--decoder-first/last-pipeline-num-layers need "
                         "--pipeline-model-parallel-size >= 2")
    for flag, n in (("first", first), ("last", last)):
        if n is not None and n < 1:
            raise ValueError(f"--decoder-{flag}-pipeline-num-layers must be >= 1, got {n}")
    rest = num_layers - (first or 0) - (last or 0)
    middle = stages - (first is not None) - (last is not None)
    if rest < 0:
        raise ValueError(f"the first/last stage layers ({num_layers - rest}) exceed the "
                         f"model's {num_layers} layers")
    if middle and not rest:
        raise ValueError(f"the first/last stage take all {num_layers} layers, leaving none "
                         f"for the other {middle} stage(s)")
    if rest and not middle:
        raise ValueError(f"with {stages} stages the first and last stage layers must add up "
                         f"to the model's {num_layers} layers, got {num_layers - rest}")
    if middle and rest % middle:
        raise ValueError(f"the {rest} layers not on the first/last stage do not split evenly "
                         f"into the other {middle} stage(s)")
    each = rest // middle if middle else 0
    counts = [each] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def apply_layout(run_args: dict, layout: Layout) -> tuple[argparse.Namespace, list[int]]:
    """(the run's flags with ``layout`` applied, stage of every layer)."""
    args = argparse.Namespace(**run_args)
    shape = ModelShape.from_args(args)
    if not layout.overridden:
        return args, [shape.stage_of(layer) for layer in range(shape.num_layers)]
    stages = layout.pipeline or args.pipeline_model_parallel_size
    counts = layers_per_stage(args.num_layers, stages, layout.first, layout.last)
    args.pipeline_model_parallel_size = stages
    args.num_layers_per_virtual_pipeline_stage = None
    args.virtual_pipeline_model_parallel_size = None
    return args, [k for k, n in enumerate(counts) for _ in range(n)]


# ---------------------------------------------------------------- problem


def _check_sites(refresh: Refresh, num_layers: int) -> None:
    for s in refresh.sites:
        try:
            layer = parse_site_id(s.site)[0]
        except ValueError:
            layer = -1
        if not 0 <= layer < num_layers:
            raise ValueError(f"{refresh.stats_path}: site {s.site!r} is not a site of the "
                             f"{num_layers}-layer model of {refresh.args_path}")


def _random_seed(run: dict) -> int:
    """The random policy's seed as the run drew it (its ``args.json``: the training seed,
    ``--snip-seed``, ``--snip-random-draw``; ``--snip-seed`` alone in runs made before)."""
    return draw_seed(run.get("seed", 0), run.get("snip_seed"), run.get("snip_random_draw", 0))


def plan_problem(refresh: Refresh, policy: str | None = None, layout: Layout = Layout(),
                 profile: DeviceProfile | None = None) -> Planning:
    """The refresh's ILP instance for ``policy`` (default: the run's) and ``layout``, its
    times on ``profile`` (default ``nominal``)."""
    run = refresh.run_args
    policy = policy or (run.get("precision") if run.get("precision") in
                        planner.STATS_POLICIES else "snip")
    if policy not in planner.STATS_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(planner.STATS_POLICIES)}, "
                         f"got {policy!r}")
    try:
        args, layer_stage = apply_layout(run, layout)
        shape = ModelShape.from_args(args)
    except AttributeError as err:
        raise ValueError(f"{refresh.args_path}: not a run's args.json ({err})") from None
    _check_sites(refresh, shape.num_layers)
    weights = (run.get("snip_loss_weight", 1.0), run.get("snip_weight_weight", 1.0))
    q = planner.quality_table(policy, refresh.sites, refresh.options, refresh.loss,
                              refresh.hyper, shape, _random_seed(run), weights)
    fixed = stage_fixed_seconds(shape, stage_of=layer_stage, profile=profile)
    meta = {"step": refresh.step, "policy": policy, "stats": refresh.stats_path,
            "pipeline_stages": shape.pipeline_stages,
            "device_profile": (profile.name if profile else "nominal")}
    problem = planner.build_problem([s.site for s in refresh.sites], refresh.options, q,
                                    shape, fixed, meta, layer_stage, profile)
    return Planning(refresh, policy, problem, args, shape, layer_stage, weights)
