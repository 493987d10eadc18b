"""The paired t test and the verdict rule of megatron_ext.compare.stats, against
scipy.stats.ttest_rel and hand-computed numbers: one seed, all differences tied, the 5-seed
threshold, the interval a "not separable" row reports, and the permutation p of a run among
random draws (checked by enumeration)."""

import itertools
import math

import pytest
from scipy import stats as sps

from megatron_ext.compare.stats import (describe, paired, paired_diffs, place_among_draws,
                                        verdict)

RUN = {1: 4.10, 2: 4.31, 3: 4.02, 4: 4.25, 5: 4.18}
REF = {1: 4.00, 2: 4.20, 3: 4.05, 4: 4.11, 5: 4.09}


def test_t_df_p_match_scipy_ttest_rel():
    diff = paired(RUN, REF)
    ref = sps.ttest_rel(list(RUN.values()), list(REF.values()))
    assert diff.t == pytest.approx(ref.statistic) and diff.p == pytest.approx(ref.pvalue)
    assert diff.df == ref.df == 4 and diff.signs == (4, 1, 0)


def test_hand_computed_three_seeds():
    # d = (1, 2, 3): mean 2, sd 1, se 1/sqrt(3), t 2 sqrt(3) = 3.4641 with 2 df;
    # two-sided p = 1 - t/sqrt(t^2 + 2) for 2 df (Student t's closed form) = 0.07418
    diff = paired_diffs([1.0, 2.0, 3.0])
    assert diff.t == pytest.approx(2 * math.sqrt(3))
    assert diff.p == pytest.approx(1 - diff.t / math.sqrt(diff.t ** 2 + 2))
    assert diff.p == pytest.approx(0.07418, abs=1e-5)
    # 95 % interval: 2 ± 4.3027 / sqrt(3)
    low, high = diff.ci()
    assert (low, high) == pytest.approx((2 - 4.302653 / math.sqrt(3), 2 + 4.302653 / math.sqrt(3)))
    # significant at p < 0.1 but 3 seeds: not separable, with the interval
    assert verdict(diff, 1) == f"not separable at 3 seeds (95 % CI {low:+.4f} to {high:+.4f})"


def test_one_seed_is_na():
    diff = paired_diffs([0.0066])
    assert (diff.se, diff.t, diff.df, diff.p, diff.ci()) == (None, None, None, None, None)
    assert verdict(diff, 1) == "n/a (1 seed)"
    assert describe(diff) == "+0.0066 (1 seed, n/a)" and "±" not in describe(diff)


def test_all_differences_tied_at_zero():
    diff = paired_diffs([0.0] * 6)
    assert diff.t is None and diff.p == 1.0 and diff.signs == (0, 0, 6)
    assert verdict(diff, -1) == "not separable at 6 seeds (95 % CI +0.0000 to +0.0000)"
    assert "t n/a, 5 df, p 1.000; 0+ 0− 6=" in describe(diff)


def test_equal_nonzero_differences_are_infinitely_significant():
    diff = paired_diffs([0.5] * 5)
    assert diff.t == math.inf and diff.p == 0.0
    assert verdict(diff, 1) == "reproduced" and verdict(diff, -1) == "refuted"


def test_five_seed_threshold():
    # the same strong effect: 4 seeds are not enough, 5 are
    four, five = paired_diffs([1.0, 1.1, 0.9, 1.05]), paired_diffs([1.0, 1.1, 0.9, 1.05, 0.95])
    assert four.p < 0.001 and five.p < 0.001
    assert verdict(four, 1).startswith("not separable at 4 seeds")
    assert verdict(five, 1) == "reproduced" and verdict(five, -1) == "refuted"
    assert verdict(five, 0) == "refuted"  # a claim of parity, a clear gap
    assert verdict(five, -1, ("lower", "higher")) == "higher"


def test_five_seeds_above_alpha_stay_not_separable():
    diff = paired_diffs([0.03, -0.01, 0.02, 0.04, -0.02])  # the 5-seed PGQ-like case
    assert 0.05 < diff.p < 1
    assert verdict(diff, 1).startswith("not separable at 5 seeds (95 % CI -")


def test_permutation_p_by_enumeration():
    run = {1: 3.0, 2: 3.0}
    draws = {1: [2.5, 3.5, 4.0], 2: [3.2, 3.1, 3.9]}  # places 1 and 0, sum 1
    place, p = place_among_draws(run, draws)
    assert place == {1: 1, 2: 0}
    # two independent places uniform on 0..3: P(sum <= 1) = 3/16
    count = sum(a + b <= 1 for a, b in itertools.product(range(4), repeat=2))
    assert p == pytest.approx(count / 16) == pytest.approx(3 / 16)
    assert place_among_draws({1: 9.0}, {1: [1.0, 2.0]}) == ({1: 2}, 1.0)
