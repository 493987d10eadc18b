"""SNIP's flags and the one frozen :class:`SnipConfig` built from them in ``validate``.

SNIP is on when ``--precision`` names one of its policies (``snip`` or a §6.1 baseline); its
hooks read this config, never the flags again. Every bad value is a one-line ``UsageError``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from megatron_ext.errors import UsageError, finite_float
from megatron_ext.extension import Conflict, no_fsdp
from megatron_ext.methods.snip import planner
from megatron_ext.methods.snip.ilp import STAGE_BALANCE, SolverConfig
from megatron_ext.methods.snip.candidates import DEFAULT_CANDIDATES, parse_candidates
from megatron_ext.methods.snip.probe_noise import PROBES
from megatron_ext.methods.snip.tensor_store import OFFLOADS
from megatron_ext.precision.random_draw import add_draw_arguments, draw_seed
from megatron_ext.precision.site_formats import SiteFormats

POLICIES = planner.STATS_POLICIES + planner.STATIC_POLICIES
"""The ``--precision`` policies SNIP owns."""
ENABLED_BY = "--precision " + " | ".join(POLICIES)
"""What switches SNIP on (for the platform's message about a flag given without it)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(f"SNIP ({ENABLED_BY})")
    g.add_argument("--snip-budget", type=finite_float, default=0.5, metavar="E_t",
                   help="target fraction of linear-layer FLOPs in FP4 (eq. 2)")
    g.add_argument("--snip-candidates", default=DEFAULT_CANDIDATES, metavar="F1,F2,...",
                   help="formats each role may take: recipes fp8/fp4/bf16 or format names "
                        "(options = one per role)")
    g.add_argument("--snip-stage-balance", choices=STAGE_BALANCE, default="paper",
                   help="paper: eq. 5 (every stage >= E_t/K); time: cap every stage's "
                        "estimated time; none: eq. 2 only")
    g.add_argument("--snip-start", type=int, default=50, metavar="STEP",
                   help="first refresh before this step")
    g.add_argument("--snip-interval", type=int, default=100, metavar="STEPS",
                   help="steps between refreshes (0: only the first)")
    g.add_argument("--snip-apply-lag", type=int, default=2, metavar="STEPS",
                   help="a refresh's plan is applied this many steps after it")
    g.add_argument("--snip-noise", type=finite_float, default=1e-2, metavar="EPS",
                   help="probe noise std relative to the gradient's RMS per token (step 2) and "
                        "the input's RMS (step 3)")
    g.add_argument("--snip-offload", choices=OFFLOADS, default="auto",
                   help="where a refresh keeps the weight snapshot, AdamW's A² and the base "
                        "gradients between their uses: host = CPU memory (a site's A² and "
                        "gradient copied to the model's device while it is in use), disk = "
                        "files in <run-dir>/snip_offload_*/ (read back one site or parameter "
                        "at a time, removed after the refresh; bounds CPU memory), none = the "
                        "model's device; auto (default) = host when the model is on a GPU, "
                        "else disk")
    g.add_argument("--snip-sites-per-pass", type=int, default=0, metavar="N",
                   help="observe at most N of a rank's sites per pass: with several "
                        "micro-batches a step every observed site sums float64 gradients "
                        "and errors over the pass (5 x 8 bytes per weight for candidates "
                        "fp8,fp4), so N bounds that memory, at the cost of repeating the "
                        "three passes once per group of N sites; 0: all sites in one set of "
                        "passes. The statistics are the same (stochastic-rounding "
                        "candidates: other draws)"),
    g.add_argument("--snip-probe", choices=PROBES, default="isotropic",
                   help="the backward probe's noise (step 2): isotropic per token (the "
                        "paper's), or dgrad: shaped like a dgrad error entering the residual "
                        "stream, ε·[W_qkv⊙γ; W_fc1⊙γ] of the last layer (tensor-model-"
                        "parallel-size 1 only; docs/snip.md)")
    g.add_argument("--snip-loss-weight", type=finite_float, default=1.0, help="w_L in Q = w_L ΔL + w_W ΔW")
    g.add_argument("--snip-weight-weight", type=finite_float, default=1.0, help="w_W in Q")
    g.add_argument("--snip-time-limit", type=finite_float, default=30.0, help="ILP seconds (HiGHS)")
    g.add_argument("--snip-mip-gap", type=finite_float, default=1e-6, help="ILP relative MIP gap")
    g.add_argument("--snip-threads", type=int, default=1, help="HiGHS threads")
    add_draw_arguments(g, "snip", "the random policy", "plan")


def active(args: argparse.Namespace) -> bool:
    """``--precision`` names one of SNIP's policies."""
    return args.precision in POLICIES


@dataclass(frozen=True)
class SnipConfig:
    """One run's SNIP settings; each field is the flag named in its docstring."""

    CONFLICTS: ClassVar[tuple[Conflict, ...]] = no_fsdp("its statistics need unsharded "
                                                        "weights")
    """The flags SNIP's policies do not run with."""
    policy: str
    """``--precision``: ``snip`` or one of its baselines."""
    candidates: dict[str, tuple[str, ...]]
    """``--snip-candidates``: role -> candidate format names."""
    options: tuple[SiteFormats, ...]
    """Every combination of one candidate per role (x varies slowest)."""
    budget: float = 0.5
    """``--snip-budget``: E_t, the target FP4 share of linear FLOPs."""
    stage_balance: str = "paper"
    """``--snip-stage-balance``."""
    start: int = 50
    """``--snip-start``: the first refresh is before this step."""
    interval: int = 100
    """``--snip-interval``: steps between refreshes (0: only the first)."""
    apply_lag: int = 2
    """``--snip-apply-lag``: a refresh's plan lands this many steps after it."""
    noise: float = 1e-2
    """``--snip-noise``: relative probe noise."""
    offload: str = "auto"
    """``--snip-offload``: where a refresh holds its snapshot, ``A²`` and base gradients
    between uses (:mod:`.tensor_store`): ``host`` memory, ``disk`` files under the run
    directory, ``none`` (the model's device), or ``auto`` (host on a GPU, else disk)."""
    probe: str = "isotropic"
    """``--snip-probe``: the backward probe's noise, isotropic or dgrad-shaped."""
    sites_per_pass: int = 0
    """``--snip-sites-per-pass``: sites a rank observes per set of passes (0: all)."""
    weights: tuple[float, float] = (1.0, 1.0)
    """``--snip-loss-weight``, ``--snip-weight-weight``: w_L and w_W of Q."""
    solver: SolverConfig = SolverConfig()
    """``--snip-time-limit``, ``--snip-mip-gap``, ``--snip-threads``."""
    seed: int = 0
    """The random policy's seed: ``precision.random_draw.draw_seed`` of the training seed,
    ``--snip-seed`` and ``--snip-random-draw``."""

    @property
    def refreshes(self) -> bool:
        """Whether the policy refreshes from measured statistics (else solved once)."""
        return self.policy in planner.STATS_POLICIES


def config_from_args(args: argparse.Namespace) -> SnipConfig | None:
    """The run's settings, None when SNIP is off; ``UsageError`` (one line) for a bad flag."""
    if not active(args):
        return None
    if not 0.0 <= args.snip_budget <= 1.0:
        raise UsageError(f"--snip-budget must be in [0, 1], got {args.snip_budget}")
    if args.snip_start < 0 or args.snip_interval < 0 or args.snip_apply_lag < 1:
        raise UsageError("--snip-start and --snip-interval must be >= 0 and "
                         "--snip-apply-lag >= 1")
    if args.snip_sites_per_pass < 0:
        raise UsageError(f"--snip-sites-per-pass must be >= 0, got {args.snip_sites_per_pass}")
    if args.snip_noise <= 0:
        raise UsageError(f"--snip-noise must be > 0, got {args.snip_noise}")
    if args.snip_probe == "dgrad" and args.tensor_model_parallel_size > 1:
        raise UsageError("--snip-probe dgrad needs --tensor-model-parallel-size 1")
    if args.snip_random_draw < 0:
        raise UsageError(f"--snip-random-draw must be >= 0, got {args.snip_random_draw}")
    try:
        cands = parse_candidates(args.snip_candidates)
    except ValueError as exc:
        raise UsageError(f"--snip-candidates: {exc}") from None
    return SnipConfig(args.precision, cands.all_formats(), tuple(cands.options()),
                      args.snip_budget, args.snip_stage_balance, args.snip_start,
                      args.snip_interval, args.snip_apply_lag, args.snip_noise,
                      args.snip_offload, args.snip_probe, args.snip_sites_per_pass,
                      (args.snip_loss_weight, args.snip_weight_weight),
                      SolverConfig(args.snip_time_limit, args.snip_mip_gap, args.snip_threads),
                      draw_seed(args.seed, args.snip_seed, args.snip_random_draw))
