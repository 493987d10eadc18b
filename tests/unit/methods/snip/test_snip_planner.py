"""Candidates and options, the option cost model, ΔL / ΔW on hand-made statistics, and every
policy's plan at the budget (the baselines of SNIP §6.1 through the same ILP)."""

import math

import numpy as np
import pytest

from megatron_ext.precision.cost import ModelShape, flop_report, site_cost, stage_fixed_seconds
from megatron_ext.sites import SITES
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.methods.snip import planner
from megatron_ext.methods.snip.divergence import (SiteStats, divergences, loss_divergence,
                                                  weight_divergences)
from megatron_ext.methods.snip.ilp import SolverConfig
from megatron_ext.methods.snip.candidates import fp4_roles, option_name, parse_candidates, parse_option_name

SHAPE = ModelShape(num_layers=6, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                   num_query_groups=4, swiglu=True, tokens=1024, pipeline_stages=2)
OPTIONS = parse_candidates("fp8,fp4").options()
SITE_IDS = [f"L{layer}.{s}" for layer in range(SHAPE.num_layers) for s in SITES]


def test_default_candidates_give_snips_eight_options():
    assert len(OPTIONS) == 8
    assert OPTIONS[0] == SiteFormats("fp8_e4m3@tile128", "fp8_e4m3@block128", "fp8_e4m3@tile128")
    assert OPTIONS[-1].dy == "fp4_e2m1@tile128+sr"
    assert sorted(fp4_roles(o) for o in OPTIONS) == [0, 1, 1, 1, 2, 2, 2, 3]
    assert all(parse_option_name(option_name(o)) == o for o in OPTIONS)
    named = parse_candidates("fp8_e4m3@tile128,fp4_e2m1@tile128,bf16")
    assert len(named.options()) == 27 and named.formats("w")[1] == "fp4_e2m1@tile128"
    assert parse_candidates("none,fp4").options()[0] == SiteFormats()  # unquantized


@pytest.mark.parametrize("spec", ["fp8", "fp8,fp8", "fp8,nope"])
def test_bad_candidates_are_refused(spec):
    with pytest.raises(ValueError):
        parse_candidates(spec)


def test_option_costs_follow_the_cost_model():
    """A GEMM is FP4 only with both operands FP4: all-FP4 = every FLOP, x+w only = fprop."""
    for o in OPTIONS:
        cost = site_cost(SHAPE, "fc1", o)
        fp4, flops, seconds = cost.fp4_flops, cost.flops, cost.seconds
        report = flop_report(lambda sid, o=o: o, ModelShape(**{**SHAPE.__dict__, "num_layers": 1,
                                                               "pipeline_stages": 1}))
        site_share = fp4 / flops
        assert seconds > 0 and 0 <= site_share <= 1
        if fp4_roles(o) == 3:
            assert site_share == 1.0 and report.fractions["fp4"] == pytest.approx(1.0)
        elif fp4_roles(o) < 2:
            assert site_share == 0.0
        else:
            assert site_share == pytest.approx(1 / 3)


def _stats(site, scale=1.0, n=256, k=256):
    per = lambda role: {f: scale * (1.0 if "fp8" in f else 16.0)
                        for f in parse_candidates("fp8,fp4").formats(role)}
    stats = {"xx": 4.0, "ww": 9.0, "dydy": 1.0, "dxdx": 1.0, "dxdxN": 2.0, "dwdw": 1.0,
             "AA": 4.0, "dgB": 1e-4, "dgF": 1e-4, "dgAB": 1e-3, "dgAF": 1e-3,
             "dxB": 1e-2, "dxBN": 2e-2, "resB": 1e-2, "noiseB": 1e-2,
             "noiseF": 1e-2, "Lx": per("x"), "ex": per("x"), "Gx": per("x"), "WGx": per("x"),
             "Lw": per("w"), "ew": per("w"), "Bw": per("w"), "Bdy": per("dy"), "Bdyw": per("dy"),
             "Gdy": per("dy"), "WGdy": per("dy")}
    return SiteStats(site, n, k, stats)


def test_loss_divergence_is_the_theorem_4_1_norm():
    s = _stats("L0.fc1")
    o = OPTIONS[-1]
    assert loss_divergence(s, o, loss=2.0) == pytest.approx(math.sqrt((16 + 16) / 256) / 2)


def test_weight_divergence_grows_with_the_error_and_reaches_lower_layers():
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "step": 10.0, "eps": 1e-8}
    sites = [_stats("L0.fc1"), _stats("L1.fc1"), _stats("L2.fc1", scale=100.0)]
    div = divergences(sites, OPTIONS, 3.0, hyper)
    fp8, fp4 = 0, len(OPTIONS) - 1
    for row in div:
        assert row[fp4].dW > row[fp8].dW > 0 and row[fp4].q == pytest.approx(row[fp4].dL + row[fp4].dW)
    assert div[2][fp4].q > div[1][fp4].q  # the sensitive site costs more
    # a site's error reaches every layer below it: the top site's ΔW has more terms
    assert div[1][fp4].dW > div[0][fp4].dW


def test_forward_reach_all_adds_the_sites_above():
    """``forward_reach="all"``: a forward error also reaches the sites above its own; the top
    site has none above, so its estimate is the paper's; dgrad-only options do not move."""
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "step": 10.0, "eps": 1e-8}
    sites = [_stats("L0.fc1"), _stats("L1.fc1"), _stats("L2.fc1")]
    paper = weight_divergences(sites, OPTIONS, hyper)
    reach = weight_divergences(sites, OPTIONS, hyper, forward_reach="all")
    assert np.allclose(reach[2], paper[2]) and (reach[:2] > paper[:2]).all()
    no_fwd = weight_divergences(sites, OPTIONS, hyper, False, forward_reach="all")
    assert np.array_equal(no_fwd, weight_divergences(sites, OPTIONS, hyper, False))
    with pytest.raises(ValueError, match="forward_reach"):
        weight_divergences(sites, OPTIONS, hyper, forward_reach="above")


def test_snip_keeps_the_sensitive_site_in_fp8():
    stats = [_stats(sid, scale=1000.0 if sid == "L3.fc2" else 1.0) for sid in SITE_IDS]
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "step": 10.0, "eps": 1e-8}
    q = planner.quality_table("snip", stats, OPTIONS, 3.0, hyper, SHAPE)
    problem = planner.build_problem(SITE_IDS, OPTIONS, q, SHAPE, [0.0, 0.0])
    plan, sol = planner.make_plan(problem, OPTIONS, "snip", 7, 0.5, "paper", SolverConfig())
    assert sol.status == "optimal" and sol.fp4_fraction >= 0.5 - 1e-9
    assert fp4_roles(plan.sites["L3.fc2"]) == 0
    assert plan.step == 7 and plan.method == "snip"


def _solve(policy, budget, seed=0, balance="paper"):
    q = planner.quality_table(policy, None, OPTIONS, shape=SHAPE, seed=seed)
    fixed = stage_fixed_seconds(ModelShape(**{**SHAPE.__dict__, "seq_length": 128,
                                              "vocab_size": 1000}))
    problem = planner.build_problem(SITE_IDS, OPTIONS, q, SHAPE, fixed)
    return planner.make_plan(problem, OPTIONS, policy, 0, budget, balance, SolverConfig())


def _fp4_sites(plan):
    return {sid for sid, f in plan.sites.items() if fp4_roles(f) >= 2}


@pytest.mark.parametrize("budget", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("policy", planner.STATIC_POLICIES)
def test_static_baselines_meet_the_budget_on_every_stage(policy, budget):
    plan, sol = _solve(policy, budget)
    assert sol.status == "optimal"
    assert sol.fp4_fraction >= budget - 1e-9
    assert all(f >= budget - 1e-9 for f in sol.stage_fp4_fraction)  # eq. 5, equal stages


def test_e_layer_type_keeps_mlp_gate_up_in_fp8():
    plan, _ = _solve("e-layer-type", 0.5)
    assert not any(sid.endswith(".fc1") for sid in _fp4_sites(plan))


def test_e_layer_id_puts_fp4_in_the_middle_layers():
    plan, _ = _solve("e-layer-id", 0.25, balance="none")
    all_fp4 = {int(sid[1:].split(".")[0]) for sid, f in plan.sites.items() if fp4_roles(f) == 3}
    assert all_fp4 and all_fp4 <= {2, 3}  # the knapsack may top up with a partial site


def test_random_is_seeded():
    a, b, c = _solve("random", 0.5, 1)[0], _solve("random", 0.5, 1)[0], _solve("random", 0.5, 2)[0]
    assert a.sites == b.sites and a.sites != c.sites


def test_error_baselines_read_quantization_errors():
    stats = [_stats(sid, scale=0.01 if sid.startswith("L0.") else 1.0) for sid in SITE_IDS]
    for policy in ("min-abs-err", "min-rel-err"):
        q = planner.quality_table(policy, stats, OPTIONS)
        assert np.all(q[:, -1] > q[:, 0])  # FP4 errs more than FP8
        assert np.all(q[:4, -1] < q[4:8, -1])  # the low-error layer is cheapest
