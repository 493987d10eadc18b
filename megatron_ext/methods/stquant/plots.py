"""STQuant's ``tools/plot_precision.py`` subcommand: ``stquant RUN_DIR_OR_FILE`` (the
optimizer-state width per layer over training, STQuant paper Fig. 6a)."""

from __future__ import annotations

from megatron_ext.extension import Plot


def _add_arguments(parser) -> None:
    parser.add_argument("widths", metavar="RUN_DIR_OR_FILE",
                        help="an --optimizer stquant-adamw run directory (its "
                             "stquant_widths.jsonl) or that file")


def _draw(args):
    from megatron_ext.viz import inputs, widths

    return widths.width_history(inputs.load_widths(args.widths))


PLOTS = (Plot("stquant", "STQuant's optimizer-state width per layer over training (STQuant "
                        "paper Fig. 6a)", _add_arguments, _draw),)
