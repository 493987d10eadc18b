"""megatron_ext.compare without training: groups, ranks with ties, margins, flag parsing.

The metrics are made up (integers chosen so every expected number is worked out by hand in
the comments); the grid's runs are grouped by ``--snip-budget`` in both flag spellings.
"""

import math

import pytest

from megatron_ext.compare.grid import Grid, RunSpec, build_grid, flag_value
from megatron_ext.compare.jobs import RunMetrics
from megatron_ext.compare.report import markdown
from megatron_ext.compare.results import collect
from megatron_ext.errors import UsageError

SEEDS = (1, 2, 3)
LOSSES = {"ref": (4, 4, 4), "a": (3, 3, 3), "b": (2, 3, 4), "c": (1, 2, 3), "d": (5, 6, 7)}
FLAGS = {"ref": (), "a": ("--snip-budget", "0.5"), "b": ("--snip-budget=0.5",),
         "c": ("--snip-budget", "0.5"), "d": ("--snip-budget", "0.25")}


def metrics(values: tuple[int, ...]) -> list[RunMetrics]:
    return [RunMetrics(10, float(v), ((10, float(v)),), ((10, float(v)),), 0.5, 0.25, 0.625)
            for v in values]


@pytest.fixture
def results():
    grid = Grid(tuple(RunSpec(n, f) for n, f in FLAGS.items()), SEEDS, reference="ref",
                group_by="--snip-budget")
    table = {(n, s): m for n, v in LOSSES.items() for s, m in zip(SEEDS, metrics(v))}
    return collect(grid, table)


def test_ranks_within_groups_with_ties(results):
    # group 0.5: means a 3, b 3, c 2 -> c 1, a and b share 2; group None: ref; group 0.25: d
    assert {n: r["group"] for n, r in results["runs"].items()} == {
        "ref": None, "a": "0.5", "b": "0.5", "c": "0.5", "d": "0.25"}
    assert {n: r["rank"] for n, r in results["runs"].items()} == {
        "ref": 1, "a": 2, "b": 2, "c": 1, "d": 1}
    assert [g["ranking"] for g in results["groups"]] == [["ref"], ["c", "a", "b"], ["d"]]
    # per seed in group 0.5: (3, 2, 1) -> c, (3, 3, 2) -> c, (3, 4, 3) -> a (tie: config order)
    assert results["groups"][1]["best_per_seed"] == {"1": "c", "2": "c", "3": "a"}
    # t = 1 / (1/sqrt(3)) = 1.73 with 2 df: two-sided p = 1 - t/sqrt(t^2 + 2) = 0.225;
    # 95 % interval 1 ± 4.3027/sqrt(3) = 1 ± 2.4841
    assert ("1. `c`, 2. `a`, 2. `b`; runner-up − best = +1.0000 ± 0.5774 (t +1.73, 2 df, "
            "p 0.225, paired: not separable at 3 seeds (95 % CI -1.4841 to +3.4841)); "
            "`c` is best on 2 of 3 seeds" in markdown(results, []))


def test_margin_and_reference_differences(results):
    # runner-up a - best c = (2, 1, 0): mean 1, sd 1, se 1/sqrt(3)
    margin = results["groups"][1]["margin"]
    assert (margin["best"], margin["runner_up"]) == ("c", "a")
    assert margin["mean"] == 1.0 and margin["se"] == pytest.approx(1 / math.sqrt(3))
    assert results["groups"][0]["margin"] is None
    # b - ref = (-2, -1, 0): mean -1, se 1/sqrt(3), t -sqrt(3), -25 % of the ref's mean 4
    diff = results["runs"]["b"]["vs_reference"]
    assert diff["diffs"] == {"1": -2.0, "2": -1.0, "3": 0.0}
    assert diff["mean"] == -1.0 and diff["t"] == pytest.approx(-math.sqrt(3))
    assert diff["df"] == 2 and diff["p"] == pytest.approx(1 - math.sqrt(3) / math.sqrt(5))
    assert diff["rel_pct"] == -25.0
    # a - ref = (-1, -1, -1): no spread, se 0, t -inf, p 0, but 3 seeds: not separable
    tied = results["runs"]["a"]["vs_reference"]
    assert tied["se"] == 0.0 and tied["t"] == -math.inf and tied["p"] == 0.0
    assert tied["verdict"].startswith("not separable at 3 seeds")
    assert results["runs"]["d"]["gemm_time_saving"] == 0.375
    text = markdown(results, [])
    assert ("| `b` | `0.5` | 2 | 3.0000 ± 0.5774 | -1.0000 ± 0.5774 | -25.00 % | t -1.73, 2 df, "
            "p 0.225 | not separable at 3 seeds (95 % CI -3.4841 to +1.4841) |" in text)


def test_flag_value_takes_the_last_one():
    assert flag_value(("--a", "1", "--a=2", "--b", "3"), "--a") == "2"
    assert flag_value(("--a", "1", "--a", "4"), "--a") == "4"
    assert flag_value(("--ab", "1"), "--a") is None


def test_command_line_replaces_and_extends_the_config():
    config = {"seeds": [1], "base_flags": "--lr 1e-3", "runs": {"x": ""}, "reference": "x"}
    grid = build_grid(config, {"seeds": "4, 5", "base_flags": "--lr 2e-3", "group_by": "lr"},
                      ["y=--lr 3e-3"])
    assert grid.seeds == (4, 5) and grid.group_by == "--lr"
    assert [grid.group_of(r) for r in grid.runs] == ["2e-3", "3e-3"]
    with pytest.raises(UsageError, match="no run has that flag"):
        build_grid(config, {"group_by": "--snip-budget"}, [])
    with pytest.raises(UsageError, match="expected NAME=FLAGS"):
        build_grid(config, {}, ["y"])


def _gap_results(gaps: dict[str, float], seeds: int, ref_loss: float = 5.0) -> dict:
    runs = {"bf16": {"group": None, "val_loss": {"mean": ref_loss}, "vs_reference": None}}
    for name, gap in gaps.items():
        runs[name] = {"group": None, "val_loss": {"mean": ref_loss + gap}, "vs_reference": {
            "mean": gap, "se": None if seeds == 1 else abs(gap) / 2,
            "rel_pct": 100 * gap / ref_loss}}
    return {"grid": {"reference": "bf16", "group_by": None, "seeds": list(range(seeds))},
            "runs": runs}


def test_a_tiny_single_seed_gap_is_a_small_bar():
    from megatron_ext.compare.figures import GAP_AXIS_FLOOR_PCT, gap_plot

    fig = gap_plot(_gap_results({"snip": 0.0005}, seeds=1))  # 0.01 % of 5.0
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert high == pytest.approx(-low) and high >= GAP_AXIS_FLOOR_PCT / 100 * 5.0
    (bar,) = ax.patches
    assert bar.get_height() / high < 0.05  # not a full-height bar
    assert [t.get_text() for t in ax.texts] == ["+0.01%"]
    assert "one seed" in ax.get_title()


def test_large_gaps_still_fill_the_axis():
    from megatron_ext.compare.figures import gap_plot

    ax = gap_plot(_gap_results({"fp4": 0.5, "fp8": -0.1}, seeds=3)).axes[0]
    assert ax.get_ylim()[1] == pytest.approx(1.2 * (0.5 + 0.25))
    assert [t.get_text() for t in ax.texts] == ["+10.00%", "-2.00%"]


def test_random_draws_expand_the_runs_with_the_placeholder():
    config = {"seeds": [1], "random_draws": 3, "reference": "recipe", "runs": {
        "recipe": "", "random": "--pgq-random --pgq-random-draw {draw}"}}
    grid = build_grid(config, {}, [])
    assert [(r.name, r.flags) for r in grid.runs] == [
        ("recipe", ()), *((f"random.d{i}", ("--pgq-random", "--pgq-random-draw", str(i)))
                          for i in range(3))]
    assert len(build_grid(config, {"random_draws": 2}, []).runs) == 3
    with pytest.raises(UsageError, match="needs random_draws"):
        build_grid({**config, "random_draws": None}, {}, [])
    with pytest.raises(UsageError, match="no run has"):
        build_grid({**config, "runs": {"recipe": ""}}, {}, [])
    with pytest.raises(UsageError, match="positive integer"):
        build_grid({**config, "random_draws": 0}, {}, [])


def test_draw_families_report_the_references_place_and_permutation_p():
    config = {"seeds": [1, 2], "random_draws": 2, "reference": "recipe",
              "runs": {"recipe": "", "random": "--x {draw}"}}
    grid = build_grid(config, {}, [])
    loss = {"recipe": (3, 3), "random.d0": (4, 2), "random.d1": (5, 6)}
    table = {(n, s): m for n, v in loss.items() for s, m in zip((1, 2), metrics(v))}
    (fam,) = collect(grid, table)["draws"]
    # seed 1: draws 4, 5 -> place 0; seed 2: draws 2, 6 -> place 1; P(sum of two U{0,1,2} <= 1)
    assert fam["place"] == {"1": 0, "2": 1} and fam["permutation_p"] == pytest.approx(3 / 9)
    # mean of the draws - recipe: (4.5 - 3, 4 - 3) = (1.5, 1)
    assert fam["draws_minus_reference"]["diffs"] == {"1": 1.5, "2": 1.0}
    assert "permutation p 0.333" in markdown(collect(grid, table), [])
