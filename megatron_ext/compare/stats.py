"""The statistics of a comparison: means, standard errors, paired differences, ranks.

Each run r is trained once per seed s (the same seeds for every run); its score is the final
validation loss ``L[r, s]``.

**Mean and standard error.** Over the n seeds, ``mean = Σ_s L[r, s] / n`` and the sample
standard deviation ``sd = sqrt(Σ_s (L[r, s] - mean)² / (n - 1))``; the standard error of the
mean is ``se = sd / sqrt(n)`` — how far the mean would move if the seeds were drawn again.
With one seed there is no spread to measure and no standard error (None).

**Paired differences.** A seed fixes the initial weights and the data order, so two runs of
the same seed differ only by their flags; much of the seed-to-seed variation (a lucky init,
an easy batch order) is shared and cancels in ``d[s] = L[r, s] - L[ref, s]``. The paired
difference is ``mean(d)`` with standard error ``sd(d) / sqrt(n)``; it is the same number as
``mean(L[r]) - mean(L[ref])`` but its standard error is usually much smaller than that of
either mean. ``mean(d) / se(d)`` is how many standard errors the difference lies from zero
(roughly: beyond 2, unlikely to be seed noise; with few seeds the t distribution's wider
tails apply — 4.3 for 95 % with 3 seeds).

**Ranks.** Within a group, runs are ranked by mean loss, 1 = lowest; equal means share the
best rank of the tie and the next rank skips (1, 2, 2, 4: "competition" ranking).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def mean(values: list[float]) -> float:
    """Arithmetic mean (at least one value)."""
    return sum(values) / len(values)


def standard_error(values: list[float]) -> float | None:
    """Sample standard deviation over sqrt(n); None for fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    centre = mean(values)
    return math.sqrt(sum((v - centre) ** 2 for v in values) / (n - 1) / n)


@dataclass(frozen=True)
class Paired:
    """Differences of one run against another, seed by seed."""

    diffs: dict[int, float]
    """Seed -> L[run, seed] - L[other, seed]."""
    mean: float
    """Mean of the differences."""
    se: float | None
    """Standard error of that mean (None with one seed)."""

    @property
    def z(self) -> float | None:
        """``mean / se``: standard errors from zero (None without a positive se)."""
        return self.mean / self.se if self.se else None


def paired(run: dict[int, float], other: dict[int, float]) -> Paired:
    """``run - other`` on every seed both have."""
    diffs = {s: run[s] - other[s] for s in run if s in other}
    values = list(diffs.values())
    return Paired(diffs, mean(values), standard_error(values))


def ranks(scores: dict[str, float]) -> dict[str, int]:
    """Competition ranks, 1 = lowest score: 1 + how many scores are strictly lower."""
    return {name: 1 + sum(other < score for other in scores.values())
            for name, score in scores.items()}
