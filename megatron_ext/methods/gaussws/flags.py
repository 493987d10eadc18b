"""GaussWS settings and their command-line flags.

``--gaussws`` picks the sites whose weights are sampled: ``od`` (the paper's [out, down]:
the last linear of each residual branch, ``proj`` and ``fc2``), ``all``, or a comma list
of ``qkv,proj,fc1,fc2``. Bit widths follow eq. 9, ``b_t = b_decay + b_i (b_init -
b_decay)`` with ``b_i`` starting at 1 (weight decay on ``b_i`` pulls b_t towards ``b_decay``),
and the eq. 10 loss adds ``λ / n Σ |b_t - b_loss|``. The paper's OPT2 setting (§4.1), the
defaults: b_init 6, b_target 0 for weight decay, b_target 4 for the bit-width loss, λ 1e-4,
32 x 32 tiles; its Llama2 setting (§4.2) is ``--gaussws-b-target-decay 4``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from megatron_ext.errors import UsageError, finite_float
from megatron_ext.extension import Conflict, no_fsdp
from megatron_ext.sites import SITES

SITE_GROUPS = {"od": ("proj", "fc2"), "all": SITES}
"""Named site sets accepted by ``--gaussws``."""


def parse_sites(spec: str) -> tuple[str, ...]:
    """``"od"`` -> ``("proj", "fc2")``; ``"all"``; or a comma list of site names (plan
    order kept); ``UsageError`` otherwise."""
    if spec in SITE_GROUPS:
        return SITE_GROUPS[spec]
    names = [s.strip() for s in spec.split(",")]
    bad = [s for s in names if s not in SITES]
    if bad or not spec.strip():
        raise UsageError(f"--gaussws {spec!r}: expected od, all or a comma list of "
                         f"{','.join(SITES)}")
    return tuple(s for s in SITES if s in names)


@dataclass(frozen=True)
class GaussWSConfig:
    """Gaussian weight sampling for one run (paper §3.2-3.7)."""

    CONFLICTS: ClassVar[tuple[Conflict, ...]] = no_fsdp(
        "use DDP or --use-distributed-optimizer")
    """The flags ``--gaussws`` does not run with."""
    sites: tuple[str, ...] = ()
    """Sites whose weights are sampled (``--gaussws``); empty: GaussWS off."""
    b_init: float = 6.0
    """Initial bit width of every tile, b_t at b_i = 1 (``--gaussws-b-init``)."""
    b_target_decay: float = 0.0
    """b_target of eq. 9: the bit width weight decay on b_i pulls b_t towards
    (``--gaussws-b-target-decay``; paper §4.1: 0)."""
    b_target_loss: float = 4.0
    """b_target of eq. 10: the bit width the bit-width loss pulls b_t towards
    (``--gaussws-b-target-loss``; paper §4.1: 4)."""
    lam: float = 1e-4
    """λ of the eq. 10 bit-width loss; 0 leaves it out (``--gaussws-lambda``, paper 1e-4)."""
    block: int = 32
    """Side of the square tiles sharing one max and one b_t (``--gaussws-block``)."""

    def __post_init__(self):
        if self.b_init == self.b_target_decay:
            raise UsageError("--gaussws-b-init must differ from --gaussws-b-target-decay "
                             "(eq. 9 scales b_i by their difference)")
        if self.block < 1:
            raise UsageError(f"--gaussws-block must be a positive integer, got {self.block}")
        if self.lam < 0:
            raise UsageError(f"--gaussws-lambda must be >= 0, got {self.lam}")

    @property
    def enabled(self) -> bool:
        """Whether any site is sampled."""
        return bool(self.sites)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GaussWSConfig:
        """The settings from parsed flags (see :func:`add_arguments`)."""
        sites = parse_sites(args.gaussws) if args.gaussws else ()
        return cls(sites, args.gaussws_b_init, args.gaussws_b_target_decay,
                   args.gaussws_b_target_loss, args.gaussws_lambda, args.gaussws_block)


def active(args: argparse.Namespace) -> bool:
    """``--gaussws SITES`` (a ``--gaussws-*`` flag without it is refused by the platform)."""
    return bool(args.gaussws)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--gaussws*`` flags, one argument group."""
    d = GaussWSConfig()
    g = parser.add_argument_group("GaussWS (Gaussian weight sampling)")
    g.add_argument("--gaussws", default=None, metavar="od|all|SITES",
                   help="sample these sites' weights: od (proj, fc2), all, or a comma list "
                        f"of {','.join(SITES)}; off when absent")
    g.add_argument("--gaussws-b-init", type=finite_float, default=d.b_init,
                   help=f"initial bit width of every 32x32 tile (default {d.b_init})")
    g.add_argument("--gaussws-b-target-decay", type=finite_float, default=d.b_target_decay,
                   help="b_target of eq. 9: the bit width weight decay on b_i pulls b_t "
                        f"towards (default {d.b_target_decay:g}, the paper's OPT2 setting; "
                        "its Llama2 setting is 4)")
    g.add_argument("--gaussws-b-target-loss", type=finite_float, default=d.b_target_loss,
                   help="b_target of eq. 10: the bit width the bit-width loss pulls b_t "
                        f"towards (default {d.b_target_loss:g})")
    g.add_argument("--gaussws-lambda", type=finite_float, default=d.lam,
                   help="weight of the bit-width loss lambda/n sum|b_t - b_target_loss| "
                        f"(eq. 10); 0 = off (default {d.lam:g}, the paper's)")
    g.add_argument("--gaussws-block", type=int, default=d.block,
                   help=f"side of the square tiles (default {d.block}, OCP MX)")
