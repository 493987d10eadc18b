"""Command line of ``tools/pgq_recipe.py``: a recipe from a saved profile (PGQ stage ii)::

    pgq_recipe.py PROFILE.json --out DIR [--pgq-format int8] [--pgq-fwd-threshold 20]
                  [--pgq-bwd-threshold 1] [--pgq-device h100|h200|b200|a100|cpu|none]
                  [--pgq-budget F] [--pgq-adversarial | --pgq-random [--pgq-seed S]]
                  [--device-profile NAME|FILE]

Writes ``DIR/recipe.md``, ``DIR/recipe.json`` (the explanation of every GEMM) and
``DIR/plan.json`` (the PrecisionPlan: ``pretrain_llama.py --precision-plan DIR/plan.json``)
atomically and prints the summary line. The recipe flags are training's (``--precision pgq``),
so a recipe made here equals the one a run with the same flags makes from that profile. Bad
input: one ``error:`` line on stderr, exit status 2, nothing written.
"""

from __future__ import annotations

import sys

from megatron_ext.errors import OneLineParser, run_cli


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="pgq_recipe.py",
                           description="Make a PGQ recipe (per-GEMM plan and its explanation) "
                                       "from a saved SQNR profile.",
                           epilog="The rules, the files and an example: docs/pgq.md")
    parser.add_argument("profile", metavar="PROFILE.json",
                        help="a PGQ profile (<run>/pgq/profile.json of --precision pgq)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="folder for recipe.md, recipe.json and plan.json (created)")
    from megatron_ext.methods.pgq.flags import add_recipe_arguments
    from megatron_ext.precision.device_profile import add_argument

    add_recipe_arguments(parser)
    add_argument(parser)
    return parser


def _run(argv: list[str]) -> None:
    from megatron_ext.methods.pgq.flags import recipe_config
    from megatron_ext.methods.pgq.profile import load_profile
    from megatron_ext.methods.pgq.recipe import make_recipe
    from megatron_ext.methods.pgq.report import summary, write_recipe

    args = build_parser().parse_args(argv)
    config = recipe_config(args)
    from megatron_ext.precision.device_profile import resolve

    recipe = make_recipe(load_profile(args.profile), config, resolve(args.device_profile))
    for path in write_recipe(recipe, args.out, with_plan=True):
        print(f"wrote {path}")
    print(summary(recipe))


def main(argv: list[str] | None = None) -> int:
    """Make one recipe; bad input -> one ``error:`` line on stderr and exit status 2."""
    return run_cli(_run, argv)


if __name__ == "__main__":
    sys.exit(main())
