"""The one exception type that means "the user asked for something invalid", and the CLI
wrapper that turns it into one line on stderr and exit status 2."""

import argparse
import math
import re
import sys


class UsageError(Exception):
    """Bad input: entry points print its message as one line and exit with status 2."""


_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf$")
"""What argparse must read as a negative value, not a flag: ``-1``, ``-.5``, ``-1e-3``
(argparse's own pattern misses the exponent form), ``-inf`` (refused by its type)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors raise ``UsageError`` (one ``error:`` line under :func:`run_cli`)
    instead of printing the usage and exiting; ``--lr -1e-3`` is a value, not a flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message):
        raise UsageError(message)


def finite_float(text: str) -> float:
    """argparse ``type``: a float that is neither infinite nor NaN."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
    return value


def run_cli(run, argv=None) -> int:
    """Call ``run(argv)`` (``sys.argv[1:]`` by default); a ``UsageError`` or ``ValueError``
    becomes one ``error:`` line on stderr and exit status 2."""
    try:
        run(sys.argv[1:] if argv is None else list(argv))
    except (UsageError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
