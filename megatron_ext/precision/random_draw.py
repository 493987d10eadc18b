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


def draw_seed(training_seed: int, fixed: int | None, draw: int) -> int:
    """The seed of draw ``draw`` on base ``fixed`` (None: ``training_seed``); draw 0 is the
    base itself, draw I > 0 a SeedSequence of (base, I)."""
    if draw < 0:
        raise ValueError(f"a random draw is >= 0, got {draw}")
    base = training_seed if fixed is None else fixed
    if draw == 0:
        return base
    return int(np.random.SeedSequence([base, draw]).generate_state(1)[0])
