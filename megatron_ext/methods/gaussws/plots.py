"""GaussWS's ``tools/plot_precision.py`` subcommand: ``gaussws RUN_DIR`` (the learned bit
widths b_t per sampled site over training, GaussWS paper Fig. 6)."""

from __future__ import annotations

from megatron_ext.extension import Plot


def _add_arguments(parser) -> None:
    parser.add_argument("run", metavar="RUN_DIR",
                        help="a --gaussws run directory (its metrics.jsonl) or that file")


def _draw(args):
    from megatron_ext.methods.gaussws.history import load_bitwidths
    from megatron_ext.viz.gaussws import bitwidth_history

    return bitwidth_history(load_bitwidths(args.run))


PLOTS = (Plot("gaussws", "GaussWS's learned bit widths b_t per sampled site over training: mean "
                        "and min-max band (GaussWS paper Fig. 6)", _add_arguments, _draw),)
