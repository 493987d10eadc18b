"""Algorithm 1 against a direct, non-incremental recomputation of eq. 5-6 (float64)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_ext.methods.gnmr.algorithm import GnmrState


def direct(norms: np.ndarray, delta: int):
    """Eq. 5 and 6 from the whole history, step by step, one unit: (agnm, gnmr, dgnmr)."""
    agnm, gnmr, dgnmr = [], [], []
    for t in range(1, len(norms) + 1):
        past = norms[:t - 1]
        gnmr.append(1.0 if t == 1 else norms[t - 1] / math.fsum(past) * (t - 1))
        agnm.append(math.fsum(norms[:t]) / t)
        window = gnmr[t - 1 - delta:t - 1]
        dgnmr.append(1.0 if t <= delta else gnmr[-1] / (math.fsum(window) / delta))
    return np.array(agnm), np.array(gnmr), np.array(dgnmr)


@pytest.mark.parametrize("delta", [1, 3, 7])
def test_matches_direct_recomputation(delta):
    rng = np.random.default_rng(delta)
    steps, units = 40, 5
    norms = rng.lognormal(0.0, 0.6, size=(steps, units)) * rng.uniform(0.1, 10, units)
    norms[17, 2] *= 30.0  # a spike
    state = GnmrState.zeros(units, delta)
    got = [state.update(row) for row in norms]
    for u in range(units):
        agnm, gnmr, dgnmr = direct(norms[:, u], delta)
        np.testing.assert_allclose([m.agnm[u] for m in got], agnm, rtol=1e-12)
        np.testing.assert_allclose([m.gnmr[u] for m in got], gnmr, rtol=1e-12)
        np.testing.assert_allclose([m.dgnmr[u] for m in got], dgnmr, rtol=1e-12)
        assert [m.norm[u] for m in got] == list(norms[:, u])
    # t <= delta: the paper's initialisation
    assert all(np.all(m.dgnmr == 1.0) for m in got[:delta])
    assert np.all(got[0].gnmr == 1.0)


def test_state_size_does_not_grow():
    """O(1) memory: δ + 2 floats per unit, whatever the number of steps."""
    state = GnmrState.zeros(3, 4)
    for t in range(200):
        state.update([1.0 + t % 3, 2.0, 0.5])
    sd = state.state_dict()
    floats = len(sd["agnm"]) + len(sd["sgnmr"]) + sum(len(row) for row in sd["ring"])
    assert floats == 3 * (4 + 2) and state.t == 200


def test_leading_zero_norms_follow_algorithm_1_literally():
    """AGNM = 0 means "no history": the first non-zero norm restarts the mean (hand computed:
    t=3 AGNM = 2; t=4 GNMR = 4/2, AGNM = 3/4 * 2 + 4/4)."""
    state = GnmrState.zeros(1, 10)
    out = [state.update([n]) for n in (0.0, 0.0, 2.0, 4.0)]
    assert [m.gnmr[0] for m in out] == [1.0, 1.0, 1.0, 2.0]
    assert [m.agnm[0] for m in out] == [0.0, 0.0, 2.0, 2.5]


def test_zero_window():
    """delta=2, norms 1,0,0,0,3 (hand computed): GNMR 1,0,0,0,12; the window (0,0) gives
    Δ-GNMR 1 for GNMR 0 and +inf for GNMR 12."""
    state = GnmrState.zeros(1, 2)
    out = [state.update([n]) for n in (1.0, 0.0, 0.0, 0.0, 3.0)]
    assert [m.gnmr[0] for m in out] == [1.0, 0.0, 0.0, 0.0, 12.0]
    assert [m.dgnmr[0] for m in out] == [1.0, 1.0, 0.0, 1.0, math.inf]


@pytest.mark.parametrize("bad", [[1.0, math.nan], [1.0, math.inf], [1.0, -1.0], [1.0]])
def test_bad_norms_rejected_without_touching_the_state(bad):
    state = GnmrState.zeros(2, 3)
    state.update([1.0, 2.0])
    before = state.state_dict()
    with pytest.raises(ValueError):
        state.update(bad)
    assert state.state_dict() == before


def test_state_dict_round_trip_is_exact():
    rng = np.random.default_rng(0)
    a = GnmrState.zeros(4, 3)
    for _ in range(11):
        a.update(rng.lognormal(size=4))
    b = GnmrState.zeros(4, 3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for _ in range(9):
        norms = rng.lognormal(size=4)
        ma, mb = a.update(norms), b.update(norms)
        for name in ("agnm", "gnmr", "dgnmr"):
            assert np.array_equal(getattr(ma, name), getattr(mb, name))
    with pytest.raises(ValueError, match="units"):
        GnmrState.zeros(5, 3).load_state_dict(a.state_dict())


def test_zeros_validates():
    with pytest.raises(ValueError, match="delta"):
        GnmrState.zeros(2, 0)
    with pytest.raises(ValueError, match="unit"):
        GnmrState.zeros(0, 2)
