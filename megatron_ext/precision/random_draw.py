"""The seed of a random baseline (PGQ's ``--pgq-random``, SNIP's ``random`` policy).

A random baseline is a distribution of plans, not one plan: its ordering is drawn from the
training seed, so every training seed takes its own positions, and ``--*-random-draw I``
picks the I-th draw of that seed (K draws: I = 0 .. K-1, one training run each; the compare
tool's ``--random-draws K`` makes them). ``--pgq-seed`` / ``--snip-seed S`` replace the
training seed as the base: the same draws on every training seed, and with draw 0 exactly the
ordering ``S`` gave before the draws existed (``--pgq-seed 0``: the runs of issue 23).
"""

from __future__ import annotations

import numpy as np


def add_draw_arguments(group, prefix: str, baseline: str, unit: str) -> None:
    """``--{prefix}-seed`` and ``--{prefix}-random-draw`` on ``group``, for the random
    ``baseline`` (its name in help) that draws one ``unit`` (plan, order) per seed."""
    group.add_argument(f"--{prefix}-seed", type=int, default=None, metavar="S",
                       help=f"base seed of {baseline} (default: the training seed --seed, so "
                            f"each training seed draws its own {unit}; S: the same {unit} on "
                            f"every seed, --{prefix}-seed 0 the {unit} of runs before the "
                            "draws)")
    group.add_argument(f"--{prefix}-random-draw", type=int, default=0, metavar="I",
                       help=f"which random {unit} of the base seed {baseline} takes (0, 1, "
                            "...: K draws per seed = K runs; compare_precision.py "
                            "--random-draws K)")


def draw_seed(training_seed: int, fixed: int | None, draw: int) -> int:
    """The seed of draw ``draw`` on base ``fixed`` (None: ``training_seed``); draw 0 is the
    base itself, draw I > 0 a SeedSequence of (base, I)."""
    if draw < 0:
        raise ValueError(f"a random draw is >= 0, got {draw}")
    base = training_seed if fixed is None else fixed
    if draw == 0:
        return base
    return int(np.random.SeedSequence([base, draw]).generate_state(1)[0])
