"""The one exception type that means "the user asked for something invalid", and the CLI
wrapper that turns it into one line on stderr and exit status 2."""

import argparse
import sys


class UsageError(Exception):
    """Bad input: entry points print its message as one line and exit with status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors raise ``UsageError`` (one ``error:`` line under :func:`run_cli`)
    instead of printing the usage and exiting."""

    def error(self, message):
        raise UsageError(message)


def run_cli(run, argv=None) -> int:
    """Call ``run(argv)`` (``sys.argv[1:]`` by default); a ``UsageError`` or ``ValueError``
    becomes one ``error:`` line on stderr and exit status 2."""
    try:
        run(sys.argv[1:] if argv is None else list(argv))
    except (UsageError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
