"""Command line of ``tools/plot_precision.py``::

    plot_precision.py plan PLAN.json --out plan.png [--num-layers N]
    plot_precision.py stages PLAN.json --pipeline-model-parallel-size P --out stages.png
                      [--model tiny] [--family llama|gpt] [--num-layers N]
                      [--num-layers-per-virtual-pipeline-stage V]
    plot_precision.py evolution RUN_DIR_OR_PLAN... --out evo.png [--color-by fp4-roles|format]
    plot_precision.py divergence DIVERGENCE.json --out div.png [--option NAME] [--metric dL]
    plot_precision.py loss RUN_DIR... --out loss.png [--labels a,b] [--smooth N]
                      [--from-step STEP]
    plot_precision.py stquant RUN_DIR --out widths.png
    plot_precision.py gnmr RUN_DIR_OR_TRACE --out gnmr.png
    plot_precision.py pgq PROFILE.json --out sqnr.png [--formats int8,fp8]
    plot_precision.py gaussws RUN_DIR --out bits.png

``plan``, ``stages`` and ``loss`` are the platform's; every other subcommand is brought by an
extension of the run (``Extension.plots``: SNIP's ``evolution`` and ``divergence``, GNMR's,
PGQ's, STQuant's, GaussWS's, each in ``methods/<name>/plots.py``), passed in by the composition
root (:func:`megatron_ext.defaults.plot_main`) as the training flags are. Bad input: one ``error:`` line on stderr, exit status 2, no output file.
Parsing only: the readers are :mod:`megatron_ext.viz.inputs`, the figures
:mod:`megatron_ext.viz.plots`.
"""

from __future__ import annotations

import argparse

from megatron_ext.errors import OneLineParser, UsageError, run_cli
from megatron_ext.io import check_output


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _subparser(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, description=help_text)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="PNG",
                        help="PNG file to write (atomically: temporary file + rename)")
    parser.add_argument("--dpi", type=_positive_int, default=100,
                        help="resolution, dots per inch (default 100)")


def _add_plan(sub) -> None:
    p = _subparser(sub, "plan", "heatmap of a plan: layer x site / role, colour = format")
    p.add_argument("plan", metavar="PLAN.json", help="a PrecisionPlan file")
    p.add_argument("--num-layers", type=_positive_int, metavar="N",
                   help="rows (default: the plan's highest layer + 1)")
    _common(p)


def _add_stages(sub) -> None:
    p = _subparser(sub, "stages", "FP4 / FP8 / BF16 FLOP fractions per pipeline stage")
    p.add_argument("plan", metavar="PLAN.json", help="a PrecisionPlan file")
    p.add_argument("--pipeline-model-parallel-size", type=_positive_int, required=True,
                   metavar="P", help="pipeline stages (megatron's even split)")
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=_positive_int, metavar="V",
                   help="interleaved schedule: layers per virtual chunk (chunk c on stage c %% P)")
    p.add_argument("--model", default="tiny", help="size preset giving the GEMM shapes "
                   "(pretrain's --model names; default tiny)")
    p.add_argument("--family", choices=("llama", "gpt"), default="llama",
                   help="preset family (both have a 'tiny'; default llama)")
    p.add_argument("--num-layers", type=_positive_int, metavar="N",
                   help="layers (default: the plan's highest layer + 1; give it when the plan "
                        "leaves trailing layers out)")
    _common(p)


def _add_loss(sub) -> None:
    p = _subparser(sub, "loss", "training / validation loss of several runs (SNIP Fig. 8)")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="run directories (their metrics.jsonl) or metrics.jsonl files")
    p.add_argument("--labels", help="comma-separated legend labels, one per run "
                                    "(default: the directory names)")
    p.add_argument("--smooth", type=_positive_int, default=1, metavar="N",
                   help="smooth the training loss: a quadratic fitted to each record and the "
                        "N // 2 on each side (centred: no lag behind the validation loss; "
                        "default 1: raw)")
    p.add_argument("--from-step", type=int, default=0, metavar="STEP",
                   help="plot only steps >= STEP, so the y axis shows the end of training "
                        "(default 0: all)")
    _common(p)


def build_parser(plots=()) -> argparse.ArgumentParser:
    """The tool's parser: the platform's ``plan``, ``stages``, ``loss``, then ``plots`` (the
    ``Extension.plots`` of the run's extensions)."""
    parser = OneLineParser(prog="plot_precision.py",
                     description="Plots of precision plans, loss curves and what the methods "
                                 "bring: SNIP refreshes and divergences, GNMR traces, PGQ "
                                 "profiles, STQuant and GaussWS widths (PNG, no display "
                                 "needed).",
                     epilog="Examples and input formats: docs/plots.md")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_plan, _add_stages, _add_loss):
        add(sub)
    for plot in plots:
        p = _subparser(sub, plot.name, plot.help)
        plot.add_arguments(p)
        _common(p)
    return parser


def _plan_layers(plan, requested: int | None) -> int:
    from megatron_ext.viz.inputs import num_layers_of

    layers = num_layers_of(plan)
    if requested is not None and requested < layers:
        raise ValueError(f"the plan has layers 0-{layers - 1}; --num-layers {requested} is "
                         "too few")
    if not (requested or layers):
        raise ValueError("the plan lists no sites; give --num-layers")
    return requested or layers


def _plot_plan(args):
    from megatron_ext.viz import inputs, plots

    plan = inputs.load_plan(args.plan)
    return plots.plan_heatmap(plan, _plan_layers(plan, args.num_layers))


def _plot_stages(args):
    from megatron_ext.precision.cost import flop_report
    from megatron_ext.viz import inputs, plots

    plan = inputs.load_plan(args.plan)
    shape = inputs.model_shape(args.family, args.model, _plan_layers(plan, args.num_layers),
                               args.pipeline_model_parallel_size,
                               args.num_layers_per_virtual_pipeline_stage)
    report = flop_report(plan.formats, shape)
    for stage, fractions in enumerate(report.stage_fractions):
        print(f"stage {stage}: " + ", ".join(f"{c.upper()} {100 * v:.1f}%"
                                             for c, v in fractions.items()))
    title = (f"{plan.method} · {args.family} {args.model}, {shape.num_layers} layers, "
             f"PP={shape.pipeline_stages}")
    return plots.stage_bars(report, title)


def _plot_loss(args):
    from megatron_ext.viz import inputs, plots

    labels = args.labels.split(",") if args.labels else [None] * len(args.runs)
    if len(labels) != len(args.runs):
        raise ValueError(f"--labels has {len(labels)} label(s) for {len(args.runs)} run(s)")
    curves = [inputs.load_loss_curve(run, label) for run, label in zip(args.runs, labels)]
    last = max(step for c in curves for step, _ in (*c.train, *c.val))
    if args.from_step > last:
        raise ValueError(f"--from-step {args.from_step}: no records at or after it (the runs "
                         f"end at step {last})")
    return plots.loss_curves(curves, args.smooth, args.from_step)


COMMANDS = {"plan": _plot_plan, "stages": _plot_stages, "loss": _plot_loss}
"""The platform's own subcommands."""


def _run(argv: list[str], plots) -> None:
    args = build_parser(plots).parse_args(argv)
    check_output(args.out, "--out", kind="file")
    draw = {**COMMANDS, **{plot.name: plot.draw for plot in plots}}[args.command]
    figure = draw(args)
    from megatron_ext.viz.plots import save_png

    try:
        save_png(figure, args.out, args.dpi)
    except OSError as exc:
        raise UsageError(f"cannot write '{args.out}': {exc.strerror}") from None
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None, plots=()) -> int:
    """Make one plot; bad input -> one ``error:`` line on stderr and exit status 2. ``plots``:
    the run's extensions' subcommands (``tools/plot_precision.py`` passes those of
    ``megatron_ext.defaults.default_extensions()``: :func:`megatron_ext.defaults.plot_main`)."""
    return run_cli(lambda args: _run(args, plots), argv)
