#!/usr/bin/env python
"""Export a PrecisionPlan as megatron-core's per-module Transformer Engine recipe (YAML).

The recipe runs the plan's sites on GPUs with upstream Megatron-LM
(``--te-precision-config-file recipe.yaml``, transformer_engine layer spec) or any
megatron-core >= 0.16 program (``TransformerConfig.quant_recipe``). Sites no TE recipe can
run as planned run in BF16 there; they are printed and listed in the YAML's header comment.

Examples:
    python tools/export_plan.py --plan runs/<ts>/precision_plan.json --out recipe.yaml
    python tools/export_plan.py --plan plan.json --num-layers 32 \\
        --pipeline-model-parallel-size 4 --out recipe.yaml

Exit status 0 when the recipe was written (whatever it could not express), 2 on bad input:
one "error: ..." line on stderr and no file written. The mapping: docs/export_plan.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.errors import OneLineParser, UsageError, run_cli  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="export_plan.py", description=__doc__.split("\n\n")[0],
                epilog="Mapping, limits and how to run the recipe: docs/export_plan.md")
    p.add_argument("--plan", required=True, metavar="PLAN.json",
                   help="a PrecisionPlan JSON file (e.g. <run dir>/precision_plan.json)")
    p.add_argument("--out", required=True, metavar="RECIPE.yaml",
                   help="the recipe to write (folders created; written atomically)")
    p.add_argument("--num-layers", type=int, metavar="L",
                   help="the model's layers: checks the plan fits and lists every site "
                        "(needed with a pipeline split)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="P",
                   help="pipeline stages of the run the recipe is for (layers split evenly; "
                        "default 1)")
    p.add_argument("--virtual-pipeline-model-parallel-size", type=int, metavar="V",
                   help="model chunks per pipeline stage (interleaved schedule)")
    return p


def layers_per_chunk(args: argparse.Namespace) -> int | None:
    """Layers per model chunk of the flags' layout (``None``: one chunk, no split)."""
    for flag in ("num_layers", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    chunks = args.pipeline_model_parallel_size * (args.virtual_pipeline_model_parallel_size or 1)
    if chunks == 1:
        return None
    if args.num_layers is None:
        raise UsageError("a pipeline split needs --num-layers (module paths count layers "
                         "within a model chunk)")
    if args.num_layers % chunks:
        raise UsageError(f"--num-layers {args.num_layers} does not split evenly into {chunks} "
                         "model chunks (uneven splits are not supported)")
    return args.num_layers // chunks


def check_out(path: str) -> None:
    """``UsageError`` unless ``path`` can be a file: not a folder, not below a file."""
    if os.path.isdir(path):
        raise UsageError(f"--out '{path}' is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise UsageError(f"--out '{path}': '{folder}' is a file, not a folder")


def _run(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    chunk = layers_per_chunk(args)
    check_out(args.out)
    # imported here, under run_cli's warning filters (megatron-core warns at import on CPU)
    from megatron_ext.precision.plan import load_plan
    from megatron_ext.precision.recipe_export import export_plan, report, write_recipe

    export = export_plan(load_plan(args.plan), args.num_layers, chunk)
    try:
        write_recipe(export, args.out)
    except OSError as exc:
        raise UsageError(f"cannot write '{args.out}': {exc.strerror}") from None
    print("\n".join(report(export)))
    print(f"wrote {args.out}: use it with Megatron-LM --te-precision-config-file {args.out}")


def main(argv: list[str] | None = None) -> int:
    """Export; bad input -> one ``error:`` line on stderr and exit status 2."""
    return run_cli(_run, argv)


if __name__ == "__main__":
    sys.exit(main())
