"""GNMR's flags: ``--gnmr`` and one ``--gnmr-*`` flag per :class:`GnmrConfig` field.

The ``--gnmr-*`` flags are absent from the parsed namespace unless given
(``argparse.SUPPRESS``), so :func:`config_from_args` passes only the given ones to
:class:`GnmrConfig`, whose defaults the help quotes; one given without ``--gnmr`` is refused
by the platform (``Extension.active``). Every bad value is a one-line ``UsageError``.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_ext.errors import UsageError, finite_float
from megatron_ext.methods.gnmr.decisions import (COMPARES, HIGH_CHOICES, GnmrConfig,
                                                 parse_max_promoted)
from megatron_ext.methods.gnmr.rules import RULES
from megatron_ext.methods.gnmr.units import GRANULARITIES

DEFAULTS = GnmrConfig()
"""The settings a flag left out takes."""


def _flag(field: str) -> str:
    return "--gnmr-" + field.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("GNMR: promote units whose gradient norm jumps "
                                  "(--gnmr, docs/gnmr.md)", argument_default=argparse.SUPPRESS)
    g.add_argument("--gnmr", action="store_true", default=False,
                   help="run GNMR over the precision plan (needs --precision or "
                        "--precision-plan): after every step, units whose gradient-norm ratio "
                        "crosses its threshold run the next steps in higher precision")
    d = DEFAULTS
    g.add_argument("--gnmr-granularity", choices=GRANULARITIES,
                   help=f"a unit is a transformer block (its 4 sites) or one site "
                        f"(default {d.granularity})")
    g.add_argument("--gnmr-high", choices=HIGH_CHOICES,
                   help=f"what a promoted site runs in: auto = each operand one class up "
                        f"(FP4 -> FP8, FP8 -> BF16), fp8 / bf16 = at least that recipe "
                        f"(default {d.high})")
    g.add_argument("--gnmr-lock", type=int, metavar="N",
                   help=f"T_lock: steps a promoted unit stays high (default {d.lock})")
    g.add_argument("--gnmr-max-promoted", metavar="K",
                   help=f"maxO: units high at once, a count (4; 0 = trace only) or a fraction "
                        f"of the units (0.25); the riskiest win (default {d.max_promoted})")
    for name, metric, var in (("alpha", "GNMR", "A"), ("beta", "Δ-GNMR", "B")):
        for suffix, stage in (("_init", "during"), ("", "after")):
            g.add_argument(_flag(name + suffix), type=finite_float, metavar=var,
                           help=f"{metric} threshold {stage} the warm-up stage "
                                f"(default {getattr(d, name + suffix)})")
    g.add_argument("--gnmr-warmup-frac", type=finite_float, metavar="F",
                   help=f"fraction of --train-iters that uses the -init thresholds "
                        f"(default {d.warmup_frac})")
    g.add_argument("--gnmr-delta", type=int, metavar="D",
                   help=f"δ: the window (steps) Δ-GNMR compares with (default {d.delta})")
    g.add_argument("--gnmr-compare", choices=COMPARES,
                   help=f"trigger on metric > threshold (ratio) or metric - 1 > threshold "
                        f"(excess) (default {d.compare})")
    g.add_argument("--gnmr-rule", choices=RULES,
                   help=f"who picks the promoted units: gnmr (Algorithm 2), or a baseline: "
                        f"first-last (the K units nearest the ends, whole run), static-topk "
                        f"(the K largest mean GNMR over the warm-up, fixed after it; "
                        f"static-topk-warm-high: every unit high during that warm-up, App. E.3), "
                        f"autoswitch (TE AutoswitchGemm: a unit whose operand underflow or "
                        f"MSE is over its threshold runs the next step high) "
                        f"(default {d.rule})")
    g.add_argument("--gnmr-topk", type=int, metavar="K",
                   help="units first-last / static-topk hold high (default: maxO, "
                        "--gnmr-max-promoted, as a count)")
    g.add_argument("--gnmr-autoswitch-underflow-pct", type=finite_float, metavar="P",
                   help=f"autoswitch: promote when an operand's underflow (percent of its "
                        f"elements flushed to zero) exceeds P (default "
                        f"{d.autoswitch_underflow_pct}, TE's)")
    g.add_argument("--gnmr-autoswitch-mse", type=finite_float, metavar="E",
                   help=f"autoswitch: promote when an operand's quantization MSE exceeds E "
                        f"(default {d.autoswitch_mse}, TE's)")


def active(args: argparse.Namespace) -> bool:
    """``--gnmr`` (a ``--gnmr-*`` flag without it is refused by the platform)."""
    return args.gnmr


NEEDS_PLAN = "--gnmr promotes sites of a precision plan: give --precision or --precision-plan"
"""The line of a ``--gnmr`` run without a base plan (``PlanController.require_plan``)."""


def config_from_args(args: argparse.Namespace) -> GnmrConfig | None:
    """The run's settings, None without ``--gnmr``; ``UsageError`` (one line) for a bad flag
    or a rule's flag with another rule."""
    if not active(args):
        return None
    given = {f.name: getattr(args, "gnmr_" + f.name) for f in dataclasses.fields(GnmrConfig)
             if hasattr(args, "gnmr_" + f.name)}
    rule = given.get("rule", DEFAULTS.rule)
    for field, rules in (("topk", ("first-last", "static-topk", "static-topk-warm-high")),
                         ("autoswitch_underflow_pct", ("autoswitch",)),
                         ("autoswitch_mse", ("autoswitch",))):
        if field in given and rule not in rules:
            raise UsageError(f"{_flag(field)} is for --gnmr-rule {' / '.join(rules)}, "
                             f"not {rule}")
    try:
        if "max_promoted" in given:
            given["max_promoted"] = parse_max_promoted(given["max_promoted"])
        return GnmrConfig(**given)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
