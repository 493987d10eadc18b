"""SNIP's ``tools/plot_precision.py`` subcommands: ``evolution`` (a plan over refreshes, SNIP
Fig. 11) and ``divergence`` (one option's divergence heatmap, SNIP Fig. 10)."""

from __future__ import annotations

from megatron_ext.extension import Plot


def _evolution_arguments(parser) -> None:
    parser.add_argument("sources", nargs="+", metavar="RUN_DIR_OR_PLAN",
                        help="run directories (their snip/step_*/plan.json) and/or plan files")
    parser.add_argument("--color-by", choices=("fp4-roles", "format"), default="fp4-roles",
                        help="fp4-roles: one row per site, colour = how many of x, w, dy are "
                             "FP4; format: one row per site and role, colour = format family "
                             "(default fp4-roles)")


def _evolution(args):
    from megatron_ext.viz import inputs, plots

    return plots.plan_evolution(inputs.load_plan_series(args.sources), args.color_by)


def _divergence_arguments(parser) -> None:
    parser.add_argument("divergence", metavar="DIVERGENCE.json",
                        help="a refresh's divergence.json (RUN/snip/step_*/divergence.json)")
    parser.add_argument("--option", metavar="NAME",
                        help="option to show (default: the one with the most FP4 roles)")
    parser.add_argument("--metric", choices=("dL", "dW", "q"), default="dL",
                        help="dL: forward loss divergence, dW: weight divergence, q: quality "
                             "loss (default dL)")


def _divergence(args):
    from megatron_ext.viz import inputs, plots

    div = inputs.load_divergence(args.divergence)
    option = args.option or inputs.default_option(div.options)
    if option not in div.options:
        raise ValueError(f"--option {option!r} is not in '{args.divergence}' "
                         f"({len(div.options)} options, e.g. {div.options[0]!r})")
    return plots.divergence_heatmap(div, option, args.metric)


PLOTS = (Plot("evolution", "a plan over refreshes (SNIP Fig. 11)", _evolution_arguments,
              _evolution),
         Plot("divergence", "divergence heatmap of one option (SNIP Fig. 10)",
              _divergence_arguments, _divergence))
