"""GNMR's ``tools/plot_precision.py`` subcommand: ``gnmr RUN_DIR_OR_TRACE`` (GNMR paper
Fig. 2-3: GNMR and Δ-GNMR per unit with their thresholds, and the promotion raster)."""

from __future__ import annotations

from megatron_ext.extension import Plot


def _add_arguments(parser) -> None:
    parser.add_argument("trace", metavar="RUN_DIR_OR_TRACE",
                        help="a --gnmr run directory (its gnmr/trace.jsonl) or a trace file")


def _draw(args):
    from megatron_ext.viz import inputs, traces

    return traces.gnmr_traces(inputs.load_gnmr_trace(args.trace))


PLOTS = (Plot("gnmr", "GNMR and Δ-GNMR per unit over training with their thresholds, and the "
                     "promotion raster (GNMR paper Fig. 2-3)", _add_arguments, _draw),)
