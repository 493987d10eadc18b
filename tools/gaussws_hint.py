#!/usr/bin/env python
"""Suggest a PrecisionPlan from the bit widths a --gaussws run learned.

Sites whose weight tiles settled at <= --fp4-max-bits (default 4) bits at the run's last
logged step become FP4 candidates (their weight, or with --fp4-roles all every operand, in
uniform:fp4's formats); every other site of the model gets uniform:fp8's. The plan is what
`pretrain_*.py --precision-plan` reads. b_t judges the weight only, and a short run's widths
have barely left --gaussws-b-init: a suggestion to check with a loss comparison
(docs/gaussws.md, "A plan from the widths").

Examples:
    python tools/gaussws_hint.py runs/gws --out plan.json
    python tools/gaussws_hint.py runs/gws/metrics.jsonl --num-layers 16 --stat mean \\
        --fp4-max-bits 4.5 --fp4-roles all --out plan.json

Exit status 0 when the plan was written (also one without FP4 sites), 2 on bad input: one
"error: ..." line on stderr, no file written.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.errors import OneLineParser, run_cli  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    from megatron_ext.methods.gaussws.hint import ROLE_CHOICES

    p = OneLineParser(prog="gaussws_hint.py", description=__doc__.split("\n\n")[0],
                      epilog="How the hint reads the widths: docs/gaussws.md")
    p.add_argument("run", metavar="RUN_DIR",
                   help="a --gaussws run directory (its metrics.jsonl) or that file")
    p.add_argument("--out", required=True, metavar="PLAN.json",
                   help="the PrecisionPlan to write (folders created; written atomically)")
    p.add_argument("--num-layers", type=int, metavar="L",
                   help="layers of the model the plan is for (default: the run's args.json, "
                        "else the highest sampled layer + 1)")
    p.add_argument("--fp4-max-bits", type=float, default=4.0, metavar="B",
                   help="a site whose b_t --stat is <= B is an FP4 candidate (default 4)")
    p.add_argument("--stat", choices=("max", "mean"), default="max",
                   help="max: every tile of the site must be <= B; mean: the tiles' mean "
                        "(default max)")
    p.add_argument("--fp4-roles", choices=ROLE_CHOICES, default="w",
                   help="w: an FP4 candidate's weight in FP4, x and dy in FP8; all: x, w and "
                        "dy in FP4 (default w)")
    return p


def run_layers(history, requested: int | None) -> int:
    """``--num-layers``, else the run's ``args.json`` ``num_layers``, else the highest
    sampled layer + 1."""
    from megatron_ext.io import read_json
    from megatron_ext.sites import parse_site_id

    if requested is not None:
        if requested < 1:
            raise ValueError(f"--num-layers must be >= 1, got {requested}")
        return requested
    args = os.path.join(os.path.dirname(os.path.abspath(history.path)), "args.json")
    if os.path.isfile(args):
        layers = read_json(args).get("num_layers")
        if isinstance(layers, int) and layers > 0:
            return layers
    return 1 + max(parse_site_id(sid)[0] for sid in history.sites)


def _run(argv: list[str]) -> None:
    from megatron_ext.io import check_output
    from megatron_ext.methods.gaussws.hint import fp4_candidates, hint_plan
    from megatron_ext.methods.gaussws.history import load_bitwidths
    from megatron_ext.precision.plan import save_plan

    args = build_parser().parse_args(argv)
    check_output(args.out, "--out", kind="file")
    history = load_bitwidths(args.run)
    layers = run_layers(history, args.num_layers)
    plan = hint_plan(history, layers, args.fp4_max_bits, args.stat, args.fp4_roles)
    fp4 = fp4_candidates(history, args.fp4_max_bits, args.stat)
    save_plan(plan, args.out)
    print(f"step {plan.step}: {len(fp4)} of {len(history.sites)} sampled sites at b_t "
          f"{args.stat} <= {args.fp4_max_bits:g} -> FP4 ({args.fp4_roles}): "
          f"{', '.join(f'{sid} {b:.2f}' for sid, b in fp4.items()) or 'none'}; "
          f"the other {len(plan.sites) - len(fp4)} sites FP8")
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> int:
    """Write the plan; bad input -> one ``error:`` line on stderr and exit status 2."""
    return run_cli(_run, argv)


if __name__ == "__main__":
    sys.exit(main())
