"""The statistics of a comparison: means, standard errors, paired differences, ranks.

Each run r is trained once per seed s (the same seeds for every run); its score is the final
validation loss ``L[r, s]``.

**Mean and standard error.** Over the n seeds, ``mean = Σ_s L[r, s] / n`` and the sample
standard deviation ``sd = sqrt(Σ_s (L[r, s] - mean)² / (n - 1))``; the standard error of the
mean is ``se = sd / sqrt(n)`` — how far the mean would move if the seeds were drawn again.
With one seed there is no spread to measure and no standard error (None).

**Paired differences.** A seed fixes the initial weights and the data order, so two runs of the
same seed differ only by their flags; much of the seed-to-seed variation (a lucky init, an easy
batch order) is shared and cancels in ``d[s] = L[r, s] - L[ref, s]``. The paired difference is
``mean(d)`` with standard error ``sd(d) / sqrt(n)``; it is the same number as ``mean(L[r]) -
mean(L[ref])`` but its standard error is usually much smaller than that of either mean. ``t =
mean(d) / se(d)`` is Student's paired t statistic with ``n - 1`` degrees of freedom; its
two-sided p (scipy.stats.t) is the chance of a ``|t|`` at least this large if the flags made no
difference. With 3 seeds t needs 4.3 for p < 0.05, with 5 seeds 2.78, with 8 2.36; the 95 %
interval ``mean ± t_0.975(n-1) · se`` bounds the effects the data leave possible.

**The verdict rule** (:func:`verdict`, the one place it is written): a claim is
*reproduced* when the difference lies in the paper's direction at p < 0.05 with at least 5
seeds, *refuted* when it lies the opposite way under the same rule, and otherwise *not
separable at n seeds*, with the 95 % interval; with one seed there is no test (n/a).

**Random draws.** A random baseline drawn K times per seed is a distribution, not one run:
:func:`place_among_draws` gives a run's place among the draws on each seed and the exact
permutation p of those places.

**Ranks.** Within a group, runs are ranked by mean loss, 1 = lowest; equal means share the
best rank of the tie and the next rank skips (1, 2, 2, 4: "competition" ranking).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import t as student_t


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
    """Differences of one run against another, seed by seed, and their paired t test."""

    diffs: dict[int, float]
    """Seed -> L[run, seed] - L[other, seed]."""
    mean: float
    """Mean of the differences."""
    se: float | None
    """Standard error of that mean (None with one seed)."""

    @property
    def n(self) -> int:
        """Number of seeds."""
        return len(self.diffs)

    @property
    def df(self) -> int | None:
        """Degrees of freedom of the t statistic, ``n - 1`` (None with one seed)."""
        return self.n - 1 if self.n > 1 else None

    @property
    def t(self) -> float | None:
        """``mean / se``; ±inf when every difference is the same non-zero number; None with
        one seed or all differences 0."""
        if self.se is None or (self.se == 0 and self.mean == 0):
            return None
        return self.mean / self.se if self.se else math.copysign(math.inf, self.mean)

    @property
    def p(self) -> float | None:
        """Two-sided p of ``t`` with ``df`` degrees of freedom (scipy's Student t); 1 when all
        differences are 0, None with one seed."""
        if self.df is None:
            return None
        return 1.0 if self.t is None else float(2 * student_t.sf(abs(self.t), self.df))

    def ci(self, level: float = 0.95) -> tuple[float, float] | None:
        """The ``level`` confidence interval of the mean difference (None with one seed)."""
        if self.df is None:
            return None
        half = float(student_t.ppf(0.5 + level / 2, self.df)) * self.se
        return self.mean - half, self.mean + half

    @property
    def signs(self) -> tuple[int, int, int]:
        """(seeds with a positive difference, negative, exactly 0)."""
        values = self.diffs.values()
        return (sum(d > 0 for d in values), sum(d < 0 for d in values),
                sum(d == 0 for d in values))


def paired(run: dict[int, float], other: dict[int, float]) -> Paired:
    """``run - other`` on every seed both have."""
    diffs = {s: run[s] - other[s] for s in run if s in other}
    values = list(diffs.values())
    return Paired(diffs, mean(values), standard_error(values))


def paired_diffs(diffs: dict[int, float] | list[float]) -> Paired:
    """A :class:`Paired` from the differences themselves (a list: seeds numbered 0, 1, ...)."""
    if not isinstance(diffs, dict):
        diffs = dict(enumerate(diffs))
    values = list(diffs.values())
    return Paired(dict(diffs), mean(values), standard_error(values))


ALPHA = 0.05
"""Two-sided significance level of a verdict."""
MIN_SEEDS = 5
"""Fewest seeds a verdict other than "not separable" needs."""
VERDICT_WORDS = ("reproduced", "refuted")
"""The words of a claim's verdict: its direction found, the opposite found."""
DIRECTION_WORDS = ("lower", "higher")
"""The words of a comparison without a paper behind it (results.md: run - reference, claimed
lower)."""


def verdict(diff: Paired, expected: int, words: tuple[str, str] = VERDICT_WORDS) -> str:
    """The verdict on a claim that the mean difference has sign ``expected`` (+1 / -1; 0: the
    claim is no difference).

    ``words[0]`` (reproduced) when the difference lies in the claimed direction at two-sided
    p < ``ALPHA`` with at least ``MIN_SEEDS`` seeds; ``words[1]`` (refuted) when it lies the
    opposite way under the same rule (for ``expected`` 0, a claim of parity: either way; a t
    test cannot show parity, only bound the gap); otherwise ``not separable at n seeds`` with
    the 95 % interval the data leave (effects outside it are excluded at p < 0.05); one
    seed: ``n/a (1 seed)``."""
    if diff.df is None:
        return "n/a (1 seed)"
    if diff.n >= MIN_SEEDS and diff.p < ALPHA:
        sign = 1 if diff.mean > 0 else -1
        return words[0] if sign == expected else words[1]
    low, high = diff.ci()
    return f"not separable at {diff.n} seeds (95 % CI {low:+.4f} to {high:+.4f})"


def place_among_draws(run: dict[int, float], draws: dict[int, list[float]]
                      ) -> tuple[dict[int, int], float]:
    """A run's place among a random baseline's K draws per seed, and its permutation p.

    ``place[s]`` = how many of seed s's draws score at most ``run[s]`` (0: the run beats every
    draw). If the run were one more random draw, each place would be uniform on 0..K and
    independent across seeds, so the one-sided p that the run is better than random is the
    chance that a sum of such places is at most the observed sum (exact, by convolution)."""
    seeds = [s for s in run if s in draws]
    place = {s: sum(d <= run[s] for d in draws[s]) for s in seeds}
    dist = np.array([1.0])
    for s in seeds:
        dist = np.convolve(dist, np.full(len(draws[s]) + 1, 1.0 / (len(draws[s]) + 1)))
    return place, float(dist[:sum(place.values()) + 1].sum())


def describe(diff: Paired, digits: int = 4) -> str:
    """``+0.0194 ± 0.0087 (t +2.23, 4 df, p 0.090; 5+ 0−)`` (``p < 0.001`` below that, ``3=``
    for differences exactly 0); one seed: ``+0.0066 (1 seed, n/a)``."""
    if diff.df is None:
        return f"{diff.mean:+.{digits}f} (1 seed, n/a)"
    pos, neg, zero = diff.signs
    t = "n/a" if diff.t is None else f"{diff.t:+.2f}"
    ties = f" {zero}=" if zero else ""
    p = "p < 0.001" if diff.p < 0.001 else f"p {diff.p:.3f}"
    return (f"{diff.mean:+.{digits}f} ± {diff.se:.{digits}f} (t {t}, {diff.df} df, {p}; "
            f"{pos}+ {neg}−{ties})")


def ranks(scores: dict[str, float]) -> dict[str, int]:
    """Competition ranks, 1 = lowest score: 1 + how many scores are strictly lower."""
    return {name: 1 + sum(other < score for other in scores.values())
            for name, score in scores.items()}


def main(argv=None) -> int:
    """``python -m megatron_ext.compare.stats [--expected {+,-,0}] D1 D2 ...``: t, df, p, the
    sign count and the verdict of paired differences."""
    import argparse

    parser = argparse.ArgumentParser(description="Paired t test of per-seed differences and "
                                     "the verdict rule (megatron_ext/compare/stats.py).")
    parser.add_argument("diffs", nargs="+", type=float, metavar="D",
                        help="per-seed differences run - reference")
    parser.add_argument("--expected", choices=("+", "-", "0"), default="-",
                        help="the claimed sign of the difference (default -: the run is lower; "
                             "0: a claim of parity)")
    opts = parser.parse_args(argv)
    diff = paired_diffs(opts.diffs)
    expected = {"+": 1, "-": -1, "0": 0}[opts.expected]
    print(f"n {diff.n}  mean {describe(diff)}")
    ci = diff.ci()
    if ci is not None:
        print(f"95 % CI {ci[0]:+.4f} to {ci[1]:+.4f}")
    print(f"verdict: {verdict(diff, expected)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
