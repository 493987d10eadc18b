"""PGQ's ``tools/plot_precision.py`` subcommand: ``pgq PROFILE.json`` (the SQNR of every GEMM
operand: layer x operand, one panel per format, PGQ Fig. 3)."""

from __future__ import annotations

from megatron_ext.extension import Plot


def _add_arguments(parser) -> None:
    parser.add_argument("profile", metavar="PROFILE.json",
                        help="a PGQ profile (<run>/pgq/profile.json of --precision pgq)")
    parser.add_argument("--formats", metavar="C1,C2,...",
                        help="candidate formats to show, one panel each (default: all "
                             "profiled)")


def _draw(args):
    from megatron_ext.methods.pgq.profile import load_profile
    from megatron_ext.viz.pgq import sqnr_heatmap

    profile = load_profile(args.profile)
    formats = args.formats.split(",") if args.formats else list(profile.candidates)
    unknown = [f for f in formats if f not in profile.candidates]
    if unknown:
        raise ValueError(f"--formats {','.join(unknown)}: not in '{args.profile}' (it has "
                         f"{', '.join(profile.candidates)})")
    return sqnr_heatmap(profile, formats)


PLOTS = (Plot("pgq", "SQNR of every GEMM operand of a PGQ profile: layer x operand, one panel "
                    "per format (PGQ Fig. 3)", _add_arguments, _draw),)
