"""Random baselines as distributions (issue 39): PGQ's ``--pgq-random`` and SNIP's ``random``
policy draw their plan from the training seed, ``--*-random-draw I`` picks the I-th draw, and
``--pgq-seed`` / ``--snip-seed`` restore one fixed plan on every training seed. The plans are
made by the methods' own recipe (PGQ, on the hand-made profile of the recipe tests) and ILP
(SNIP, the planner tests' shape), through training's real argument parser."""

import sys
from pathlib import Path

import pytest

from megatron_ext import extension as ext
from megatron_ext.defaults import default_extensions
from megatron_ext.methods.pgq.flags import recipe_config
from megatron_ext.methods.pgq.recipe import make_recipe
from megatron_ext.methods.snip.flags import config_from_args
from megatron_ext.precision.random_draw import draw_seed
from megatron_ext.training.arguments import parse_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "methods" / "pgq"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "methods" / "snip"))
from pgq_synthetic import synthetic_profile  # noqa: E402
from test_snip_planner import _solve  # noqa: E402

PROFILE = synthetic_profile()
PGQ = ["--precision", "pgq", "--pgq-random", "--pgq-device", "none", "--pgq-budget", "0.5",
       "--pgq-forward", "all"]


def _args(flags):
    return parse_args("llama", flags, ext.args_provider(default_extensions()))


def _pgq_plan(flags) -> frozenset[str]:
    recipe = make_recipe(PROFILE, recipe_config(_args([*PGQ, *flags])))
    return frozenset(d.name for d in recipe.decisions if d.quantized)


def test_draw_seed_keeps_the_base_for_draw_zero():
    assert draw_seed(1234, None, 0) == 1234 and draw_seed(1234, 0, 0) == 0
    draws = {draw_seed(1234, None, i) for i in range(8)}
    assert len(draws) == 8 and draw_seed(1234, None, 3) == draw_seed(99, 1234, 3)
    with pytest.raises(ValueError):
        draw_seed(1, None, -1)


def test_pgq_random_draws_from_the_training_seed():
    assert _pgq_plan(["--seed", "1"]) != _pgq_plan(["--seed", "2"])
    # --pgq-seed 0: the plan of every training seed is the one the seed-0 order gives
    assert (_pgq_plan(["--seed", "1", "--pgq-seed", "0"])
            == _pgq_plan(["--seed", "2", "--pgq-seed", "0"]) == _pgq_plan(["--seed", "0"]))


def test_pgq_k_draws_are_k_plans():
    plans = {_pgq_plan(["--seed", "1234", "--pgq-random-draw", str(i)]) for i in range(4)}
    assert len(plans) == 4


def test_snip_random_draws_from_the_training_seed():
    seeds = [config_from_args(_args(["--precision", "random", "--seed", s])).seed
             for s in ("1", "2")]
    assert seeds == [1, 2]
    assert _solve("random", 0.5, 1)[0].sites != _solve("random", 0.5, 2)[0].sites
    draws = [config_from_args(_args(["--precision", "random", "--seed", "1234",
                                     "--snip-random-draw", str(i)])).seed for i in range(3)]
    plans = [frozenset(_solve("random", 0.5, s)[0].sites.items()) for s in draws]
    assert len(set(plans)) == 3
    fixed = config_from_args(_args(["--precision", "random", "--seed", "7", "--snip-seed", "0"]))
    assert fixed.seed == 0
