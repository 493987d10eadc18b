"""The score engine (eq. 4-14) against numpy on raw gradients and a hand computation."""

import math

import numpy as np
import pytest
import torch

from megatron_ext.methods.stquant.score import (
    ScoreConfig,
    ScoreEngine,
    auto_tau,
    factors,
    map_bits,
    sech,
)


def sums_of(grads: list[np.ndarray]) -> torch.Tensor:
    return torch.tensor([[np.sum(g * g), np.sum(np.abs(g)), g.size] for g in grads])


def test_factors_match_numpy_on_the_raw_gradients():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(5000) * 1e-3, rng.standard_t(3, 700), np.zeros(64)]
    n, r, v = factors(sums_of(grads), eps=1e-30)
    for i, g in enumerate(grads):
        mag = np.abs(g)
        assert n[i].item() == pytest.approx(np.sqrt(np.mean(g ** 2)), rel=1e-12)
        assert v[i].item() == pytest.approx(np.mean(g ** 2), rel=1e-12, abs=1e-300)
        expected_r = np.std(mag) / (np.mean(mag) + 1e-30)
        assert r[i].item() == pytest.approx(expected_r, rel=1e-9, abs=1e-12)


def test_hand_computed_scores_of_a_layer_and_its_scaled_copy():
    # B = 4 A: same variation (ratio 1), n_B = 4 n_A, v_B = 16 v_A; tau huge: log2 S_1 = 1.
    # means: N = 2.5 n_A, V = 8.5 v_A.
    a = np.array([1.0, 2.0, 3.0, 5.0]) * 1e-3
    engine = ScoreEngine(ScoreConfig(tau=1e12), num_layers=2)
    assert engine.bits == [16, 16]
    bits = engine.update(1, sums_of([a, 4 * a]))
    score_a = 7.2 + math.log2(1 / 2.5) + math.log2(1 / 8.5) + 1  # 3.79
    score_b = 7.2 + math.log2(4 / 2.5) + math.log2(16 / 8.5) + 1  # 9.79
    assert engine.scores == pytest.approx([score_a, score_b], abs=1e-9)
    assert bits == [4, 8]
    # second update, same statistics: the bias-corrected references are unchanged
    # (raw EMA 0.19 x mean, correction 1 - 0.81); only S_t moves (still ~2 here)
    engine.update(2, sums_of([a, 4 * a]))
    assert engine.scores == pytest.approx([score_a, score_b], abs=1e-9)


def test_equal_layers_score_phi_plus_the_annealing():
    g = np.linspace(-1, 1, 101)
    engine = ScoreEngine(ScoreConfig(tau=10.0), num_layers=3)
    engine.update(10, sums_of([g, g, g]))
    expected = 7.2 + math.log2(1 + 1 / math.cosh(1.0))
    assert engine.scores == pytest.approx([expected] * 3, abs=1e-12)
    assert engine.bits == [8, 8, 8]


def test_a_layer_without_gradient_gets_four_bits_and_no_nan():
    engine = ScoreEngine(ScoreConfig(tau=5.0), num_layers=2)
    bits = engine.update(1, sums_of([np.zeros(4096), np.ones(4096)]))
    assert bits[0] == 4 and all(math.isfinite(s) for s in engine.scores)


@pytest.mark.parametrize("score, bits", [(6.79, 4), (6.8, 8), (11.99, 8), (12.0, 16),
                                         (23.9, 16), (24.0, 32), (-1e9, 4), (1e9, 32)])
def test_map_thresholds(score, bits):
    assert map_bits(score, (6.8, 12.0, 24.0)) == bits


def test_annealing_starts_at_two_and_decays_to_one():
    assert 1 + sech(0.0) == 2.0
    values = [1 + sech(t / 50) for t in range(0, 1000, 50)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert 1 + sech(1e6) == 1.0  # no overflow
    assert sech(3.0) == pytest.approx(1 / math.cosh(3.0), rel=1e-15)


def test_update_schedule_first_steps_then_every_u():
    engine = ScoreEngine(ScoreConfig(tau=1.0, update_every=10), num_layers=1)
    assert [t for t in range(1, 31) if engine.due(t)] == [1, 2, 3, 4, 10, 20, 30]


def test_auto_tau_grows_with_depth_and_shrinks_with_batch():
    assert auto_tau(12, 256) == pytest.approx(50.0)
    assert auto_tau(4, 8) == pytest.approx(50 / 3 * math.sqrt(32))
    assert auto_tau(24, 256) == pytest.approx(100.0)
    assert auto_tau(12, 1024) == pytest.approx(25.0)
    assert auto_tau(1, 10 ** 9) == 1.0


def test_state_round_trip_continues_identically():
    rng = np.random.default_rng(1)
    batches = [sums_of([rng.standard_normal(300) * s for s in (1e-3, 1e-2, 1e-1)])
               for _ in range(6)]
    config = ScoreConfig(tau=3.0)
    whole = ScoreEngine(config, num_layers=3)
    first = ScoreEngine(config, num_layers=3)
    for t, sums in enumerate(batches[:3], 1):
        whole.update(t, sums)
        first.update(t, sums)
    resumed = ScoreEngine(config, num_layers=3)
    resumed.load_state_dict(first.state_dict())
    for t, sums in enumerate(batches[3:], 4):
        assert whole.update(t, sums) == resumed.update(t, sums)
        assert whole.scores == resumed.scores
    with pytest.raises(ValueError, match="3 layers"):
        ScoreEngine(config, num_layers=2).load_state_dict(first.state_dict())
