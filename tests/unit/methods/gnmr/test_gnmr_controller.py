"""Algorithm 2 on scripted norm sequences whose promotions were worked out by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_ext.methods.gnmr.decisions import (
    GnmrConfig, GnmrController, parse_max_promoted)

# δ = 100 keeps Δ-GNMR at 1 for these short scripts, so only GNMR can trigger
GNMR_ONLY = dict(alpha_init=1.5, alpha=1.5, beta_init=10.0, beta=10.0, delta=100)


def run(config: GnmrConfig, norms, units=None, total=100):
    norms = np.asarray(norms, dtype=float).reshape(len(norms), -1)
    units = units or [f"L{i}" for i in range(norms.shape[1])]
    ctl = GnmrController.create(config, units, total)
    return ctl, [ctl.step(t, row) for t, row in enumerate(norms, start=1)]


def test_lock_holds_then_demotes():
    """Norms 1,1,1,2,1,...: GNMR_4 = 2/1 > 1.5 promotes with lock 3; steps 5, 6 count it down
    (GNMR 1/1.25, 1/1.2 stay under); step 7 reaches 0 and demotes: high for steps 5-7."""
    _, out = run(GnmrConfig(lock=3, **GNMR_ONLY), [1, 1, 1, 2, 1, 1, 1, 1, 1])
    assert [d.trace["units"]["L0"]["high"] for d in out] == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert [d.trace["units"]["L0"]["lock"] for d in out] == [0, 0, 0, 3, 2, 1, 0, 0, 0]
    assert [d.step for d in out if d.promotions] == [4]
    assert [d.step for d in out if d.demotions] == [7]
    assert out[4].trace["units"]["L0"]["gnmr"] == pytest.approx(0.8)


def test_trigger_during_lock_rearms_it():
    """A second spike at step 6 (AGNM_5 = 1.2, GNMR = 3/1.2 = 2.5) resets the lock to 3:
    demotion moves from step 7 to step 9, and there is no second promotion."""
    _, out = run(GnmrConfig(lock=3, **GNMR_ONLY), [1, 1, 1, 2, 1, 3, 1, 1, 1, 1])
    assert [d.trace["units"]["L0"]["lock"] for d in out] == [0, 0, 0, 3, 2, 3, 2, 1, 0, 0]
    assert [d.step for d in out if d.promotions] == [4]
    assert [d.step for d in out if d.demotions] == [9]


def test_lock_one_is_the_next_step_only():
    _, out = run(GnmrConfig(lock=1, **GNMR_ONLY), [1, 1, 2, 1, 1])
    assert [d.trace["units"]["L0"]["high"] for d in out] == [0, 0, 1, 0, 0]


def test_budget_keeps_the_riskiest():
    """Step 4: GNMR = 3, 2, 4, 1.8 all > 1.5; maxO 2 keeps L2 (risk 4/1.5) and L0 (3/1.5).
    Step 5: L1 jumps (GNMR = 10/1.25 = 8); L0 and L2 are held only by their locks, with risk
    GNMR/1.5 = (1/1.5)/1.5 and (1/1.75)/1.5, so the new L1 displaces L2, the lower of them."""
    norms = [[1, 1, 1, 1]] * 3 + [[3, 2, 4, 1.8], [1, 10, 1, 1]]
    ctl, out = run(GnmrConfig(lock=5, max_promoted=2, **GNMR_ONLY), norms)
    assert out[3].promoted == ("L0", "L2")
    assert out[3].metrics()["gnmr_over_alpha"] == 4
    assert out[3].metrics()["gnmr_budget_dropped"] == 2
    assert out[4].promoted == ("L0", "L1")
    assert (out[4].promotions, out[4].demotions) == (("L1",), ("L2",))
    assert out[4].trace["units"]["L2"]["lock"] == 0  # turned away: the lock is gone
    assert out[4].trace["units"]["L0"]["lock"] == 4


def test_budget_ties_go_to_the_deeper_unit():
    norms = [[1, 1]] * 3 + [[3, 3]]
    _, out = run(GnmrConfig(lock=5, max_promoted=1, **GNMR_ONLY), norms)
    assert out[3].promoted == ("L1",)


def test_budget_zero_traces_but_never_promotes():
    _, out = run(GnmrConfig(max_promoted=0, **GNMR_ONLY), [1, 1, 5, 1])
    assert all(d.promoted == () for d in out)
    assert out[2].metrics()["gnmr_over_alpha"] == 1


def test_two_stage_schedule():
    """T = 200, warm-up 0.025 -> 5 iterations at α_init = 1.5. GNMR 1.3 at step 5 stays low;
    step 6: AGNM_5 = 5.3/5 = 1.06, GNMR = 1.3/1.06 = 1.226 > α = 1.1 promotes."""
    config = GnmrConfig(alpha_init=1.5, alpha=1.1, beta_init=10.0, beta=10.0, delta=100)
    assert config.thresholds(5, 200) == (1.5, 10.0)
    assert config.thresholds(6, 200) == (1.1, 10.0)
    _, out = run(config, [1, 1, 1, 1, 1.3, 1.3], total=200)
    assert [d.promoted for d in out][4:] == [(), ("L0",)]
    assert out[5].trace["units"]["L0"]["gnmr"] == pytest.approx(1.3 / 1.06)
    assert (out[4].trace["alpha"], out[5].trace["alpha"]) == (1.5, 1.1)


def test_delta_gnmr_triggers_alone():
    """δ = 2, β = 1.5: GNMR_5 = 1.6 over a window (1, 1) gives Δ-GNMR 1.6 > 1.5; α = 100."""
    config = GnmrConfig(alpha_init=100.0, alpha=100.0, beta_init=1.5, beta=1.5, delta=2)
    _, out = run(config, [1, 1, 1, 1, 1.6])
    assert out[4].trace["units"]["L0"]["dgnmr"] == pytest.approx(1.6)
    assert out[4].metrics()["gnmr_over_beta"] == 1 and out[4].metrics()["gnmr_over_alpha"] == 0
    assert out[4].promoted == ("L0",)


def test_paper_literal_thresholds_need_the_excess_comparison():
    """The paper's fixed α = 0.9 read as a ratio fires on step 1 (GNMR = 1) for every unit;
    read as an excess (GNMR - 1 > 0.9) it fires only on a near-doubling."""
    literal = dict(alpha_init=0.9, alpha=0.9, beta_init=0.3, beta=0.3, max_promoted=1.0)
    _, out = run(GnmrConfig(compare="ratio", **literal), [[1, 1, 1]] * 3)
    assert out[0].promoted == ("L0", "L1", "L2")
    _, out = run(GnmrConfig(compare="excess", delta=100, **literal), [1, 1, 1, 1.8, 1, 1, 6])
    assert [bool(d.promoted) for d in out] == [False] * 6 + [True]


def test_on_nonfinite_promotes_the_bad_units_first():
    config = GnmrConfig(lock=4, max_promoted=2, **GNMR_ONLY)
    ctl, _ = run(config, [[1, 1, 1]] * 3 + [[2, 1, 1]])
    assert ctl.promoted == ("L0",)
    before = ctl.state.state_dict()
    d = ctl.on_nonfinite(5, [1.0, math.nan, math.inf])
    assert d.promoted == ("L1", "L2") and d.demotions == ("L0",)
    assert d.trace["nonfinite"] is True and d.trace["units"]["L1"]["norm"] is None
    assert d.trace["units"]["L1"]["lock"] == 4
    assert ctl.state.state_dict() == before  # Algorithm 1 did not observe the step
    json.dumps(d.trace, allow_nan=False)


def test_on_nonfinite_without_bad_norms_takes_the_largest_relative():
    """AGNM = 1, 10, 1 after three steps; norms 2, 5, 1 are 2x, 0.5x, 1x their means: L0."""
    ctl, _ = run(GnmrConfig(**GNMR_ONLY), [[1, 10, 1]] * 3)
    assert ctl.on_nonfinite(4, [2.0, 5.0, 1.0]).promotions == ("L0",)
    fresh = GnmrController.create(GnmrConfig(), ["L0", "L1"], 10)
    assert fresh.on_nonfinite(1, [3.0, 2.0]).promotions == ("L0",)  # no history: raw norm


def test_trace_record_shape():
    _, out = run(GnmrConfig(**GNMR_ONLY), [[1, 2]] * 2, units=["L0.qkv", "L0.fc1"])
    rec = json.loads(json.dumps(out[1].trace, allow_nan=False))
    assert set(rec) == {"step", "alpha", "beta", "units"} and rec["step"] == 2
    assert set(rec["units"]["L0.fc1"]) == {"norm", "agnm", "gnmr", "dgnmr", "high", "lock"}
    assert rec["units"]["L0.fc1"]["norm"] == 2.0


def test_resume_reproduces_the_uninterrupted_run():
    """30 steps straight vs 15 + state_dict through JSON + 15 more: identical traces, with
    the save falling between a promotion and its demotion and a non-finite step after it."""
    rng = np.random.default_rng(3)
    norms = rng.lognormal(0.0, 0.3, size=(30, 6))
    norms[13, 1] *= 4.0
    norms[20, 4] *= 4.0
    config = GnmrConfig(lock=6, max_promoted=2, delta=4)

    def steps(ctl, first, last):
        out = []
        for t in range(first, last + 1):
            if t == 18:
                out.append(ctl.on_nonfinite(t, [1.0, math.nan, 1.0, 1.0, 1.0, 1.0]).trace)
            else:
                out.append(ctl.step(t, norms[t - 1]).trace)
        return out

    straight = steps(GnmrController.create(config, [f"L{i}" for i in range(6)], 30), 1, 30)
    first = GnmrController.create(config, [f"L{i}" for i in range(6)], 30)
    head = steps(first, 1, 15)
    assert first.lock.max() > 0, "the save should fall inside a lock"
    second = GnmrController.create(config, [f"L{i}" for i in range(6)], 30)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + steps(second, 16, 30) == straight
    assert any(t["units"][u]["high"] for t in straight[20:] for u in t["units"])


def test_load_refuses_other_units():
    a = GnmrController.create(GnmrConfig(), ["L0", "L1"], 10)
    b = GnmrController.create(GnmrConfig(), ["L0", "L2"], 10)
    with pytest.raises(ValueError, match="other units"):
        b.load_state_dict(a.state_dict())


def test_budget_counts():
    assert GnmrConfig(max_promoted=0.25).budget(12) == 3
    assert GnmrConfig(max_promoted=0.29).budget(100) == 29
    assert GnmrConfig(max_promoted=0.01).budget(12) == 1
    assert GnmrConfig(max_promoted=1.0).budget(12) == 12
    assert GnmrConfig(max_promoted=20).budget(12) == 12
    assert GnmrConfig(max_promoted=1).budget(12) == 1


@pytest.mark.parametrize("text, value", [("4", 4), ("0", 0), ("0.25", 0.25), ("1.0", 1.0)])
def test_parse_max_promoted(text, value):
    got = parse_max_promoted(text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ["-1", "1.5", "0.0", "a", "", "1/4"])
def test_parse_max_promoted_rejects(text):
    with pytest.raises(ValueError, match="--gnmr-max-promoted"):
        parse_max_promoted(text)


@pytest.mark.parametrize("change, flag", [
    ({"granularity": "layer"}, "granularity"), ({"high": "fp4"}, "high"),
    ({"compare": "diff"}, "compare"), ({"lock": 0}, "lock"), ({"delta": 1.5}, "delta"),
    ({"alpha": 0.0}, "alpha"), ({"beta_init": math.nan}, "beta-init"),
    ({"warmup_frac": 1.5}, "warmup-frac"), ({"max_promoted": -2}, "max-promoted"),
])
def test_config_rejects(change, flag):
    with pytest.raises(ValueError, match=f"--gnmr-{flag}"):
        GnmrConfig(**change)


def test_exceedance_counts_apart_from_held_unit_steps():
    """Norms 1,1,1,2,1,1 on one unit with lock 3: GNMR crosses 1.5 once (step 4) — one
    exceeding unit-step — while the lock holds the unit high for 3 (steps 5-7, of which
    5 and 6 are decided by step 6). The same count under a baseline rule (first-last holds
    the unit every step), and it survives a state round trip."""
    ctl, out = run(GnmrConfig(lock=3, **GNMR_ONLY), [1, 1, 1, 2, 1, 1])
    assert [d.metrics()["gnmr_exceed_alpha"] for d in out] == [0, 0, 0, 1, 1, 1]
    assert out[-1].metrics()["gnmr_exceed_beta"] == 0
    assert out[-1].metrics()["gnmr_unit_steps_high"] == 2
    rule, rule_out = run(GnmrConfig(rule="first-last", topk=1, **GNMR_ONLY), [1, 1, 1, 2, 1, 1])
    assert rule_out[-1].metrics()["gnmr_exceed_alpha"] == 1
    assert rule_out[-1].metrics()["gnmr_unit_steps_high"] == 6
    again = GnmrController.create(GnmrConfig(lock=3, **GNMR_ONLY), ["L0"], 100)
    again.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert again.step(7, [5.0]).metrics()["gnmr_exceed_alpha"] == 2
