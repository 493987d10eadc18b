"""PGQ's flags, defined once: the recipe flags are shared by training (``--precision pgq``) and
``tools/pgq_recipe.py``; the profile flags are training's. A run's flags become one frozen
:class:`PgqConfig` in ``validate``; its hooks read the config, never the flags again. Checks
raise ``UsageError`` with one line."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import ClassVar

from megatron_ext.errors import UsageError, finite_float
from megatron_ext.extension import Conflict
from megatron_ext.methods.pgq.recipe import FORWARD, MODES, NO_ROOFLINE, RecipeConfig
from megatron_ext.methods.pgq.sqnr import CANDIDATES
from megatron_ext.precision.cost import DEVICES
from megatron_ext.precision.random_draw import add_draw_arguments, draw_seed
from megatron_ext.precision.site_formats import SiteFormats

DEFAULT = RecipeConfig()
POLICY = "pgq"
"""The ``--precision`` policy that switches PGQ on."""


def add_recipe_arguments(group) -> None:
    """The recipe flags (``--pgq-format`` ... ``--pgq-seed``) on ``group``."""
    group.add_argument("--pgq-format", default=DEFAULT.format, metavar="CANDIDATE",
                       help="candidate the quantized GEMMs run in: "
                            + ", ".join(f"{n} ({f.x}/{f.w}/{f.dy})" for n, f in
                                        CANDIDATES.items()))
    group.add_argument("--pgq-fwd-threshold", type=finite_float, default=DEFAULT.fwd_threshold,
                       metavar="RATIO", help="quantize an fprop GEMM iff the lower SQNR of its "
                       "operands (ratio, not dB) is at least this")
    group.add_argument("--pgq-bwd-threshold", type=finite_float, default=DEFAULT.bwd_threshold,
                       metavar="RATIO", help="the same for dgrad and wgrad GEMMs")
    group.add_argument("--pgq-device", choices=[*DEVICES, NO_ROOFLINE], default=DEFAULT.device,
                       help="roofline preset: only GEMMs above its ridge point (peak BF16 "
                            "FLOP/s over memory bandwidth) may be quantized; none: no filter")
    group.add_argument("--pgq-budget", type=finite_float, default=None, metavar="F",
                       help="scale both thresholds (bisection) so that at least this fraction "
                            "of the linear-layer FLOPs is quantized (SNIP's --snip-budget "
                            "with an FP4 format)")
    group.add_argument("--pgq-adversarial", action="store_true",
                       help="validation: quantize the lowest-SQNR-margin GEMMs instead, at "
                            "the recipe's quantized FLOP fraction")
    group.add_argument("--pgq-random", action="store_true",
                       help="validation: a random recipe at the recipe's quantized FLOP "
                            "fraction")
    add_draw_arguments(group, "pgq", "--pgq-random", "order")
    group.add_argument("--pgq-forward", choices=FORWARD, default=DEFAULT.forward,
                       help="threshold: forward GEMMs decided by their SQNR like backward ones "
                            "(default); all / none: every forward GEMM quantized / kept in "
                            "every mode, the recipe, --pgq-adversarial and --pgq-random then "
                            "choose among backward GEMMs only (the paper's validation)")
    group.add_argument("--pgq-logits", action="store_true",
                       help="make the logits GEMMs (output layer) quantizable like the linear "
                            "sites' (default: profiled and reported only)")


def add_profile_arguments(group) -> None:
    """Training's profile flags."""
    group.add_argument("--pgq-profile-steps", type=int, default=2, metavar="N",
                       help="profile N batches (observed passes, no update) before step "
                            "--pgq-profile-start, then switch to the recipe's plan")
    group.add_argument("--pgq-profile-start", type=int, default=0, metavar="N",
                       help="train N steps with nothing quantized (the safe plan) and profile "
                            "before step N+1, after the early transient (default 0: at start)")
    group.add_argument("--pgq-candidates", default=None, metavar="C1,C2,...|all",
                       help="candidate formats to measure every operand's SQNR in (default: "
                            "--pgq-format's alone, all the recipe reads; 'all': every "
                            "candidate, for the heatmap and other formats' recipes, at about "
                            "one normal step of profile time per candidate)")
    group.add_argument("--pgq-profile", default=None, metavar="PROFILE.json",
                       help="make the recipe from this saved profile instead of profiling "
                            "(the plan is then known before training starts)")


def recipe_config(args: argparse.Namespace) -> RecipeConfig:
    """The recipe flags checked (the format is checked against the profile later)."""
    for flag in ("fwd", "bwd"):
        value = getattr(args, f"pgq_{flag}_threshold")
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"--pgq-{flag}-threshold must be a positive SQNR ratio, got {value}")
    budget = args.pgq_budget
    if budget is not None and not 0.0 <= budget <= 1.0:
        raise UsageError(f"--pgq-budget must be in [0, 1], got {budget}")
    if args.pgq_adversarial and args.pgq_random:
        raise UsageError("--pgq-adversarial and --pgq-random exclude each other")
    mode = MODES[1] if args.pgq_adversarial else MODES[2] if args.pgq_random else MODES[0]
    if args.pgq_random_draw < 0:
        raise UsageError(f"--pgq-random-draw must be >= 0, got {args.pgq_random_draw}")
    seed = draw_seed(getattr(args, "seed", 0), args.pgq_seed, args.pgq_random_draw)
    return RecipeConfig(args.pgq_format, args.pgq_fwd_threshold, args.pgq_bwd_threshold,
                        args.pgq_device, budget, mode, seed, args.pgq_forward,
                        args.pgq_logits)


def candidates(args: argparse.Namespace) -> dict[str, SiteFormats]:
    """``--pgq-candidates`` checked, with ``--pgq-format`` among them (default: it alone)."""
    spec = (args.pgq_format if args.pgq_candidates is None else
            ",".join(CANDIDATES) if args.pgq_candidates.strip() == "all" else args.pgq_candidates)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown or not names:
        raise UsageError(f"--pgq-candidates: unknown {unknown or 'empty list'}; choose from "
                         f"{', '.join(CANDIDATES)}")
    if args.pgq_format not in names:
        raise UsageError(f"--pgq-format {args.pgq_format!r} is not among --pgq-candidates "
                         f"({', '.join(names)})")
    return {n: CANDIDATES[n] for n in dict.fromkeys(names)}


def active(args: argparse.Namespace) -> bool:
    """``--precision pgq``."""
    return args.precision == POLICY


@dataclass(frozen=True)
class PgqConfig:
    """One run's PGQ settings; each field is the flag named in its docstring."""

    CONFLICTS: ClassVar[tuple[Conflict, ...]] = ()
    """The flags ``--precision pgq`` does not run with (none)."""
    recipe: RecipeConfig
    """The recipe flags, ``--pgq-format`` ... ``--pgq-logits`` (:func:`recipe_config`)."""
    profile_steps: int = 2
    """``--pgq-profile-steps``: batches the profile observes."""
    profile_start: int = 0
    """``--pgq-profile-start``: steps trained under the safe plan before the profile."""
    candidates: dict[str, SiteFormats] = field(default_factory=dict)
    """``--pgq-candidates`` (:func:`candidates`): formats the profile measures; empty with
    ``--pgq-profile``."""
    profile: str | None = None
    """``--pgq-profile``: the saved profile the recipe is made from (None: profile in the
    run)."""
    device_profile: str | None = None
    """``--device-profile`` (the platform's flag): the device the recipe's estimated time is
    costed on (None: this process's device)."""


def config_from_args(args: argparse.Namespace) -> PgqConfig | None:
    """The run's settings, None without ``--precision pgq``; ``UsageError`` (one line) for a
    bad flag."""
    if not active(args):
        return None
    if args.pgq_profile_steps < 1:
        raise UsageError(f"--pgq-profile-steps must be >= 1, got {args.pgq_profile_steps}")
    if not 0 <= args.pgq_profile_start < args.train_iters:
        raise UsageError(f"--pgq-profile-start must be in [0, --train-iters), got "
                         f"{args.pgq_profile_start}")
    return PgqConfig(recipe_config(args), args.pgq_profile_steps, args.pgq_profile_start,
                     {} if args.pgq_profile else candidates(args), args.pgq_profile,
                     getattr(args, "device_profile", None))
