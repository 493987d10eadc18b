"""Command-line pieces shared by ``tools/snip_analyze.py`` and ``tools/tune_precision.py``.

Argument types (a fraction in [0, 1], a list of them, a positive number), the flags that
select saved statistics (``--args``, ``--policy``, the pipeline-layout overrides of
:mod:`megatron_ext.methods.snip.offline`) and the solver flags. Solver settings and the stage
balance default to the run's own (``--snip-time-limit`` etc. in its args.json) when the
problem comes from a run's statistics, else to the ILP's defaults. Light on imports: the
``--problem`` mode of ``snip_analyze.py`` never loads torch.
"""

from __future__ import annotations

import argparse

from megatron_ext.methods.snip.ilp import STAGE_BALANCE, SolverConfig

_SOLVER_FLAGS = {"time_limit": "snip_time_limit", "mip_gap": "snip_mip_gap",
                 "threads": "snip_threads"}
"""Solver flag -> the training flag it defaults to in a run's args.json."""


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {value:g}")
    return value


def fractions(text: str) -> list[float]:
    """argparse type: comma-separated fractions in [0, 1], e.g. ``0.25,0.5``."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}")
    return [fraction(p) for p in parts]


def positive(kind):
    """argparse type: a ``kind`` (int or float) > 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {kind.__name__}: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
        return value
    return parse


def add_stats_arguments(parser: argparse.ArgumentParser) -> None:
    """``--args``, ``--policy`` and the layout overrides (used with ``--stats``)."""
    g = parser.add_argument_group("saved statistics (with --stats)")
    g.add_argument("--args", metavar="JSON",
                   help="the run's args.json (default: <run>/args.json next to the stats)")
    g.add_argument("--policy", metavar="NAME",
                   help="quality table: snip (ΔL + ΔW), min-abs-err or min-rel-err "
                        "(default: the run's --precision)")
    g = parser.add_argument_group("pipeline layout what-ifs (default: the run's layout)")
    g.add_argument("--pipeline-model-parallel-size", type=positive(int), metavar="P",
                   help="pipeline stages (layers split evenly unless the flags below)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=positive(int), metavar="N",
                   help="layers on the first stage; the rest split evenly (Megatron-LM)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=positive(int), metavar="N",
                   help="layers on the last stage; the rest split evenly (Megatron-LM)")


def add_solver_arguments(parser: argparse.ArgumentParser) -> None:
    """``--stage-balance``, ``--time-limit``, ``--mip-gap``, ``--threads``."""
    parser.add_argument("--stage-balance", choices=STAGE_BALANCE,
                        help="pipeline-stage rows: 'paper' = SNIP eq. 5 (every stage supplies "
                             "E_T/K of all FLOPs in FP4), 'time' = every stage's estimated "
                             "time within the bound B of docs/snip.md, 'none' = eq. 1-4 only "
                             "(default: the run's --snip-stage-balance with --stats, else "
                             "paper)")
    parser.add_argument("--time-limit", type=positive(float), metavar="S",
                        help="seconds before the best plan found so far is taken "
                             "(default: the run's, else 30)")
    parser.add_argument("--mip-gap", type=float, metavar="G",
                        help="relative gap at which a plan counts as optimal "
                             "(default: the run's, else 1e-6)")
    parser.add_argument("--threads", type=positive(int), metavar="N",
                        help="HiGHS threads (default: the run's, else 1)")


def layout_of(ns: argparse.Namespace):
    """The :class:`~megatron_ext.methods.snip.offline.Layout` of the parsed flags."""
    from megatron_ext.methods.snip.offline import Layout

    return Layout(ns.pipeline_model_parallel_size, ns.decoder_first_pipeline_num_layers,
                  ns.decoder_last_pipeline_num_layers)


def layout_given(ns: argparse.Namespace) -> bool:
    """True when any layout override was given."""
    return any(getattr(ns, name, None) is not None for name in
               ("pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers"))


def solver_config(ns: argparse.Namespace, run_args: dict | None = None) -> SolverConfig:
    """The flags' SolverConfig; unset values from ``run_args`` (args.json), else defaults."""
    run_args, default = run_args or {}, SolverConfig()
    values = {name: getattr(ns, name) if getattr(ns, name) is not None
              else run_args.get(flag, getattr(default, name))
              for name, flag in _SOLVER_FLAGS.items()}
    if values["mip_gap"] < 0:
        raise ValueError(f"argument --mip-gap: must be >= 0, got {values['mip_gap']}")
    return SolverConfig(**values)


def stage_balance_of(ns: argparse.Namespace, run_args: dict | None = None) -> str:
    """``--stage-balance``, else the run's ``--snip-stage-balance``, else ``paper``."""
    return ns.stage_balance or (run_args or {}).get("snip_stage_balance") or "paper"
