"""The SNIP ILP against brute force, scipy.optimize.milp and its own invariants."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from snip_reference import (
    TOL,
    brute_force,
    plan_indices,
    plan_rows,
    random_problem,
    scipy_objective,
    time_bound,
)

from megatron_ext.methods.snip import ilp, ilp_arrays, incumbent
from megatron_ext.methods.snip.highs import BlockResult
from megatron_ext.methods.snip.ilp import SolverConfig, safe_plan, solve
from megatron_ext.methods.snip.problem import Option, Problem, Site
from megatron_ext.methods.snip.synthetic import option_name, synthetic_problem

MODES = ("paper", "time", "none")


def quiet_solve(*args, **kwargs):
    """solve() with fallback warnings silenced (the tests check the status instead)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return solve(*args, **kwargs)


def assert_meets_rows(problem, solution, budget, mode):
    _, ok = plan_rows(problem, plan_indices(problem, solution.choice), budget, mode)
    assert ok[0], f"plan breaks a row: {solution}"


def small_cases(count: int):
    """(problem, budget) pairs: ≤ 6 sites x ≤ 4 options, 1-3 stages, integer and real
    FLOPs, ties, and budgets both random and exactly reachable (tight rows)."""
    rng = np.random.default_rng(1234)
    for case in range(count):
        stages = int(rng.integers(1, 4))
        problem = random_problem(rng, int(rng.integers(stages, 7)), int(rng.integers(1, 5)),
                                 stages, integer_flops=case % 2 == 0, ties=case % 5 == 0)
        if case % 3 == 0:  # the FP4 fraction of a random plan: rows hold with equality
            plan = np.array([[rng.integers(len(s.options)) for s in problem.sites]])
            fp4 = sum(s.options[j].fp4_flops for s, j in zip(problem.sites, plan[0]))
            budget = fp4 / problem.total_flops
        else:
            budget = float(rng.choice([0.0, rng.random(), 1.0]))
        yield problem, budget


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("start", [True, False], ids=["start", "no-start"])
def test_equals_brute_force(mode, start):
    checked = infeasible = 0
    for problem, budget in small_cases(60):
        expected, _ = brute_force(problem, budget, mode)
        solution = quiet_solve(problem, budget, mode, SolverConfig(start=start))
        if expected is None:
            assert solution.status == "infeasible-fallback"
            assert solution.choice == safe_plan(problem)
            infeasible += 1
            continue
        assert solution.status == "optimal", solution.message
        assert solution.objective == pytest.approx(expected, rel=1e-9, abs=1e-9)
        assert_meets_rows(problem, solution, budget, mode)
        checked += 1
    assert checked >= 30 and infeasible >= 1  # both outcomes were exercised


def test_knapsack_start_is_exact():
    """The dynamic-programming start alone already equals brute force on each stage."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        problem = random_problem(rng, int(rng.integers(1, 7)), int(rng.integers(1, 5)), 1)
        budget = float(rng.random())
        tab = ilp_arrays.tables(problem)
        (block,) = ilp_arrays.blocks(problem, tab, tab.valid, budget, "none", None)
        cost = tab.q[block.site, block.option]
        pick = incumbent.knapsack(block, cost)
        expected, _ = brute_force(problem, budget, "none")
        if expected is None:
            assert pick is None
        else:
            assert cost[pick].sum() == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_equals_scipy_milp(mode):
    for seed, (layers, stages, budget) in enumerate([(6, 2, 0.3), (8, 4, 0.5), (12, 3, 0.75),
                                                     (9, 3, 0.6)]):
        problem = synthetic_problem(layers, stages=stages, seed=seed, shape="tinyllama")
        expected = scipy_objective(problem, budget, mode)
        solution = quiet_solve(problem, budget, mode)
        if expected is None:
            assert solution.fallback
            continue
        assert solution.status == "optimal"
        assert solution.objective == pytest.approx(expected, rel=1e-6)
        assert_meets_rows(problem, solution, budget, mode)


@pytest.mark.parametrize("mode", MODES)
def test_pruning_start_and_warm_start_never_change_the_optimum(mode):
    rng = np.random.default_rng(99)
    for case in range(12):
        problem = random_problem(rng, 6, 4, 2, integer_flops=case % 2 == 0, ties=case % 3 == 0)
        budget = float(rng.random())
        reference = quiet_solve(problem, budget, mode, SolverConfig(prune=False, start=False))
        random_warm = {s.site: s.options[rng.integers(len(s.options))].name
                       for s in problem.sites}
        for config, warm in [(SolverConfig(), None), (SolverConfig(start=False), None),
                             (SolverConfig(), reference.choice),
                             (SolverConfig(start=False), random_warm)]:
            solution = quiet_solve(problem, budget, mode, config, warm)
            assert solution.status == reference.status
            assert solution.objective == pytest.approx(reference.objective, abs=1e-9)


def test_dominated_options_are_pruned():
    problem = synthetic_problem(4, seed=0)
    solution = solve(problem, 0.5, "paper")
    # x, w or dy alone in FP4 runs no FP4 GEMM (dominated by all-FP8); two of the three
    # two-role options tie on FP4 FLOPs and lose on q.
    assert solution.pruned == 4 * 4 * 5
    kept = [(), ("x", "w", "dy"), ("x", "w"), ("w", "dy"), ("x", "dy")]
    assert set(solution.choice.values()) <= {option_name(roles) for roles in kept}


def test_warm_start_with_a_dominated_or_unknown_option_is_accepted():
    problem = synthetic_problem(4, stages=2, seed=1)
    warm = {s.site: option_name(("x",)) for s in problem.sites}  # dominated everywhere
    warm["L0.qkv"] = "no-such-option"
    warm["L99.qkv"] = option_name(())
    assert (solve(problem, 0.5, "time", warm_start=warm).objective ==
            pytest.approx(solve(problem, 0.5, "time").objective, abs=1e-9))


def test_eq5_is_infeasible_on_uneven_stages_where_time_mode_is_not():
    """TinyLlama's 22 layers on 4 stages (6, 6, 5, 5): eq. 5 asks each stage for 1/4 of
    E_t·F, more than a 5-layer stage holds once E_t > 20/22."""
    problem = synthetic_problem(22, stages=4, seed=0, shape="tinyllama")
    with pytest.warns(RuntimeWarning, match="cannot all be met"):
        paper = solve(problem, 0.95, "paper")
    assert paper.status == "infeasible-fallback" and paper.fallback
    assert paper.choice == safe_plan(problem) and paper.fp4_fraction == 0.0
    assert paper.mip_gap is None
    timed = solve(problem, 0.95, "time")
    assert timed.status == "optimal" and timed.fp4_fraction >= 0.95
    assert max(timed.stage_time) <= timed.time_bound * (1 + TOL)


def test_paper_mode_gives_small_stages_more_fp4():
    problem = synthetic_problem(22, stages=4, seed=0, shape="tinyllama")
    solution = solve(problem, 0.75, "paper")
    total, k = problem.total_flops, problem.num_stages
    stage_flops = [sum(s.flops for s in problem.sites if s.stage == j) for j in range(k)]
    for fraction, flops in zip(solution.stage_fp4_fraction, stage_flops):
        assert fraction * flops >= 0.75 * total / k * (1 - 1e-9)  # eq. 5 as written
    assert min(solution.stage_fp4_fraction[2:]) > max(solution.stage_fp4_fraction[:2])


def test_budget_beyond_what_options_offer_falls_back():
    problem = synthetic_problem(3, options=1, seed=0)  # only all-FP8: no FP4 at all
    for mode in MODES:
        with pytest.warns(RuntimeWarning):
            solution = solve(problem, 0.1, mode)
        assert solution.status == "infeasible-fallback"
    assert solve(problem, 0.0, "paper").status == "optimal"


def test_time_limit_returns_a_feasible_plan_or_the_safe_plan():
    problem = synthetic_problem(320, stages=8, seed=0)
    for mode in ("paper", "time"):
        for start in (True, False):
            solution = quiet_solve(problem, 0.5, mode,
                                   SolverConfig(time_limit=1e-3, start=start))
            assert solution.status in ("optimal", "feasible", "timeout")
            if solution.status == "timeout":
                assert solution.choice == safe_plan(problem) and solution.message
            else:
                assert_meets_rows(problem, solution, 0.5, mode)
            if solution.status == "feasible":
                assert "time limit" in solution.message
            if start:  # the constructed starting plan is there even without time
                assert solution.status in ("optimal", "feasible")


def test_solver_error_falls_back(monkeypatch):
    monkeypatch.setattr(ilp, "run_highs", lambda *a, **k: BlockResult("error", detail="boom"))
    problem = synthetic_problem(2, seed=0)
    with pytest.warns(RuntimeWarning, match="boom"):
        solution = solve(problem, 0.5, "none")
    assert solution.status == "error-fallback" and solution.choice == safe_plan(problem)


def test_thread_count_can_change_between_solves():
    problem = synthetic_problem(8, stages=2, seed=3)
    objectives = {solve(problem, 0.5, "time", SolverConfig(threads=t)).objective
                  for t in (2, 1, 2)}
    assert len(objectives) == 1


def test_time_bound_is_half_the_budget_saving_without_fixed_time():
    problem = synthetic_problem(8, stages=2, seed=0)
    bare = Problem(problem.sites, problem.num_stages)
    all_fp8 = max(sum(s.options[0].time for s in bare.sites if s.stage == k) for k in (0, 1))
    for budget in (0.0, 0.3, 1.0):
        assert (ilp_arrays.stage_time_bound(bare, budget) ==
                pytest.approx((1 - budget / 2) * all_fp8, rel=1e-12))
        assert (ilp_arrays.stage_time_bound(problem, budget) ==
                pytest.approx(time_bound(problem, budget), rel=1e-12))


def test_solution_reports_match_the_plan():
    problem = synthetic_problem(16, stages=4, seed=2)
    solution = solve(problem, 0.6, "time")
    chosen = {s.site: next(o for o in s.options if o.name == solution.choice[s.site])
              for s in problem.sites}
    assert solution.objective == pytest.approx(sum(o.q for o in chosen.values()))
    assert solution.fp4_fraction == pytest.approx(
        sum(o.fp4_flops for o in chosen.values()) / problem.total_flops)
    for k in range(4):
        here = [s for s in problem.sites if s.stage == k]
        assert solution.stage_fp4_fraction[k] == pytest.approx(
            sum(chosen[s.site].fp4_flops for s in here) / sum(s.flops for s in here))
        assert solution.stage_time[k] == pytest.approx(
            problem.stage_fixed_time[k] + sum(chosen[s.site].time for s in here))
    assert solution.mip_gap is not None and solution.mip_gap <= 1e-6
    assert list(solution.to_dict()["choice"]) == [s.site for s in problem.sites]


@pytest.mark.parametrize("budget", [-0.1, 1.5, float("nan"), True])
def test_bad_budget_or_mode_raise(budget):
    problem = synthetic_problem(2, seed=0)
    with pytest.raises(ValueError, match="budget"):
        solve(problem, budget)
    with pytest.raises(ValueError, match="stage_balance"):
        solve(problem, 0.5, "balanced")


def test_time_mode_needs_times():
    site = Site("a", 0, (Option("fp8", 0.0, 0.0, 1.0), Option("fp4", 1.0, 1.0, 1.0)))
    with pytest.raises(ValueError, match="option times"):
        solve(Problem((site,)), 0.5, "time")


def test_synthetic_shapes():
    problem = synthetic_problem(22, stages=4, seed=0, shape="tinyllama")
    assert ([sum(1 for s in problem.sites if s.stage == k) // 4 for k in range(4)] ==
            [6, 6, 5, 5])
    big = synthetic_problem(2, seed=0)
    qkv = big.sites[0]
    assert qkv.flops == 3 * 2 * 8192 * (8192 + 2 * 8 * 128) * 8192  # 3 GEMMs of 2·T·N·K
    fractions = {o.name: o.fp4_flops / o.flops for o in qkv.options}
    assert fractions[option_name(())] == fractions[option_name(("x",))] == 0
    assert fractions[option_name(("x", "w", "dy"))] == 1
    assert fractions[option_name(("x", "w"))] == pytest.approx(1 / 3)
    assert big.stage_fixed_time[-1] > 0  # output layer and loss on the last stage
    with pytest.raises(ValueError, match="options"):
        synthetic_problem(2, options=9)
