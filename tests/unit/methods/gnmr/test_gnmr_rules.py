"""The baseline rules (first-last, static-topk, autoswitch) and the promoted unit-step count,
on scripted norms and statistics, against decisions recomputed here from their definitions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_ext.methods.gnmr.decisions import GnmrConfig, GnmrController
from megatron_ext.methods.gnmr.rules import OperandStats, end_order
from megatron_ext.methods.gnmr.units import unit_ids

BLOCKS = ["L0", "L1", "L2", "L3"]


def run(config, norms, units=BLOCKS, total=100, stats=None):
    ctl = GnmrController.create(config, units, total)
    out = [ctl.step(t, row, None if stats is None else stats[t - 1])
           for t, row in enumerate(np.asarray(norms, dtype=float), start=1)]
    return ctl, out


def high(decision) -> str:
    return "".join("H" if v["high"] else "." for v in decision.trace["units"].values())


def test_end_order_blocks_and_sites():
    assert [BLOCKS[i] for i in end_order(BLOCKS, 4)] == ["L0", "L3", "L1", "L2"]
    five = unit_ids(5, "block")
    assert [five[i] for i in end_order(five, 5)] == ["L0", "L4", "L1", "L3", "L2"]
    sites = unit_ids(2, "site")
    assert [sites[i] for i in end_order(sites, 2)] == sites  # L0's four, then L1's


def test_first_last_holds_its_set_from_step_one():
    ctl = GnmrController.create(GnmrConfig(rule="first-last", topk=2), BLOCKS, 10)
    assert ctl.promoted == ("L0", "L3")  # before step 1: the overlay of step 1
    _, out = run(GnmrConfig(rule="first-last", topk=2), np.ones((5, 4)) * [1, 9, 1, 1])
    assert [high(d) for d in out] == ["H..H"] * 5
    assert [d.metrics()["gnmr_unit_steps_high"] for d in out] == [2, 4, 6, 8, 10]
    assert all(d.metrics()["gnmr_units"] == 4 for d in out)


def test_first_last_default_k_is_max_promoted():
    ctl = GnmrController.create(GnmrConfig(rule="first-last", max_promoted=0.5),
                                unit_ids(4, "site"), 10)
    assert ctl.promoted == ("L0.qkv", "L0.proj", "L0.fc1", "L0.fc2", "L3.qkv", "L3.proj",
                            "L3.fc1", "L3.fc2")


def _gnmr_direct(norms: np.ndarray) -> np.ndarray:
    """Eq. 5 straight from the definition: GNMR_t = n_t / mean(n_1..n_{t-1}), GNMR_1 = 1."""
    out = np.ones_like(norms)
    for t in range(1, len(norms)):
        out[t] = norms[t] / norms[:t].mean(axis=0)
    return out


def test_static_topk_picks_the_largest_mean_gnmr_of_the_warmup():
    """Warm-up = round(0.1 · 40) = 4 steps; K = 2 by mean GNMR over steps 1-4, recomputed
    directly; the set stays fixed although L0 spikes later."""
    rng = np.random.default_rng(3)
    norms = rng.uniform(0.5, 2.0, size=(12, 5))
    norms[8, 0] = 50.0
    config = GnmrConfig(rule="static-topk", topk=2, warmup_frac=0.1)
    ctl, out = run(config, norms, unit_ids(5, "block"), total=40)
    mean = _gnmr_direct(norms)[:4].mean(axis=0)
    chosen = sorted(np.argsort(-mean)[:2])
    expect = "".join("H" if i in chosen else "." for i in range(5))
    assert [high(d) for d in out] == ["....."] * 3 + [expect] * 9
    assert out[-1].metrics()["gnmr_unit_steps_high"] == 2 * 8  # high in steps 5..12
    assert out[8].trace["units"]["L0"]["gnmr"] > 10  # the spike, ignored


def test_static_topk_warm_high_runs_every_unit_high_through_the_warmup():
    """App. E.3: the same choice as static-topk, but all units high before it (from step 1
    through the warm-up's last step 4), and those unit-steps counted: 5 units x 4 steps,
    then 2 units x 8 steps (5..12)."""
    rng = np.random.default_rng(3)
    norms = rng.uniform(0.5, 2.0, size=(12, 5))
    plain = GnmrConfig(rule="static-topk", topk=2, warmup_frac=0.1)
    warm = GnmrConfig(rule="static-topk-warm-high", topk=2, warmup_frac=0.1)
    _, base = run(plain, norms, unit_ids(5, "block"), total=40)
    ctl = GnmrController.create(warm, unit_ids(5, "block"), 40)
    assert ctl.promoted == tuple(unit_ids(5, "block"))  # before step 1
    _, out = run(warm, norms, unit_ids(5, "block"), total=40)
    assert [high(d) for d in out] == ["HHHHH"] * 3 + [high(d) for d in base[3:]]
    assert out[-1].metrics()["gnmr_unit_steps_high"] == 5 * 4 + 2 * 8


def test_static_topk_ties_go_deeper_and_zero_warmup_is_refused():
    _, out = run(GnmrConfig(rule="static-topk", topk=1, warmup_frac=0.1), np.ones((5, 4)),
                 total=20)
    assert high(out[1]) == "...H"
    with pytest.raises(ValueError, match="warm-up"):
        GnmrController.create(GnmrConfig(rule="static-topk", warmup_frac=0.0), BLOCKS, 20)


def test_static_topk_skipped_warmup_step_is_left_out_of_the_mean():
    """Warm-up 2 of 20; step 2 skipped: the choice after it uses step 1 only (GNMR 1
    everywhere, so the tie goes to L3) although step 2's norm of L1 was non-finite."""
    config = GnmrConfig(rule="static-topk", topk=1, warmup_frac=0.1)
    ctl = GnmrController.create(config, BLOCKS, 20)
    ctl.step(1, [1, 1, 1, 1])
    assert ctl.on_nonfinite(2, [1, np.nan, 1, 1]).promoted == ("L3",)
    assert ctl.step(3, [1, 5, 1, 1]).promoted == ("L3",)


def _stats(pct, mse):
    pct, mse = np.asarray(pct, float), np.asarray(mse, float)
    return OperandStats(pct, mse, mse / 10)


def test_autoswitch_one_step_no_hold_no_budget():
    """Strictly over either threshold -> high for the next step only; every unit may be high
    (maxO 1 does not apply); a NaN statistic counts as over."""
    stats = [_stats([1, 6, 5, 0], [0, 0, 1e-4, 0]),      # L1 over underflow; L2 at both: not
             _stats([0, 0, 0, 0], [2e-4, 0, 0, 0]),      # L0 over MSE
             _stats([9, 9, 9, 9], [1, 1, 1, 1]),         # all
             _stats([0, np.nan, 0, 0], [0, 0, 0, 0]),    # NaN
             _stats([0, 0, 0, 0], [0, 0, 0, 0])]
    config = GnmrConfig(rule="autoswitch", max_promoted=1)
    ctl, out = run(config, np.ones((5, 4)), stats=stats)
    assert [high(d) for d in out] == [".H..", "H...", "HHHH", ".H..", "...."]
    assert [d.metrics()["gnmr_unit_steps_high"] for d in out] == [0, 1, 2, 6, 7]
    assert out[2].metrics()["gnmr_autoswitch_underflow"] == 4
    assert out[0].metrics()["gnmr_autoswitch_mse"] == 0
    assert out[0].trace["units"]["L1"]["underflow_pct"] == 6.0
    assert out[3].trace["units"]["L1"]["underflow_pct"] is None  # strict JSON
    custom = GnmrConfig(rule="autoswitch", autoswitch_underflow_pct=8, autoswitch_mse=0.5)
    _, out = run(custom, np.ones((5, 4)), stats=stats)
    assert [high(d) for d in out] == ["....", "....", "HHHH", ".H..", "...."]


def test_autoswitch_needs_statistics():
    ctl = GnmrController.create(GnmrConfig(rule="autoswitch"), BLOCKS, 10)
    with pytest.raises(ValueError, match="operand statistics"):
        ctl.step(1, [1, 1, 1, 1])


def test_unit_steps_count_the_units_that_ran_high_under_gnmr():
    """Algorithm 2: the count after step t is the number of high entries in the trace lines
    of steps 1..t-1 (the decision after step s sets step s+1)."""
    rng = np.random.default_rng(0)
    norms = rng.lognormal(0, 0.6, size=(40, 4))
    _, out = run(GnmrConfig(lock=3, max_promoted=2, alpha_init=1.3, alpha=1.3), norms)
    ran = np.cumsum([0] + [high(d).count("H") for d in out[:-1]])
    assert [d.metrics()["gnmr_unit_steps_high"] for d in out] == ran.tolist()
    assert ran[-1] > 0


@pytest.mark.parametrize("rule", ["static-topk", "autoswitch", "first-last"])
def test_resume_mid_run_matches_the_uninterrupted_run(rule):
    """Save after step 3 (inside static-topk's warm-up of 5), load into a fresh controller
    through JSON, continue: the same traces and counts as running straight."""
    rng = np.random.default_rng(1)
    norms = rng.uniform(0.5, 2.0, size=(12, 4))
    stats = [_stats(rng.uniform(0, 10, 4), rng.uniform(0, 2e-4, 4)) for _ in range(12)]
    config = (GnmrConfig(rule=rule, topk=1, warmup_frac=0.25) if rule != "autoswitch"
              else GnmrConfig(rule=rule))
    _, straight = run(config, norms, total=20, stats=stats)
    first = GnmrController.create(config, BLOCKS, 20)
    for t in range(1, 4):
        first.step(t, norms[t - 1], stats[t - 1])
    second = GnmrController.create(config, BLOCKS, 20)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    resumed = [second.step(t, norms[t - 1], stats[t - 1]) for t in range(4, 13)]
    assert [d.trace for d in resumed] == [d.trace for d in straight[3:]]
    assert [d.metrics() for d in resumed] == [d.metrics() for d in straight[3:]]


def test_load_refuses_another_rule():
    state = GnmrController.create(GnmrConfig(rule="first-last"), BLOCKS, 10).state_dict()
    with pytest.raises(ValueError, match="--gnmr-rule first-last"):
        GnmrController.create(GnmrConfig(), BLOCKS, 10).load_state_dict(state)


@pytest.mark.parametrize("bad", [dict(rule="nope"), dict(topk=-1), dict(topk=True),
                                 dict(autoswitch_mse=-1.0),
                                 dict(autoswitch_underflow_pct=float("nan"))])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="--gnmr-"):
        GnmrConfig(**bad)
