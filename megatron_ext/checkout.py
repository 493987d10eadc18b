"""Which checkout of megatron_ext a process runs, said where it could surprise.

Every entry point (``pretrain_*.py``, ``tools/``, ``benchmarks/``) puts its own checkout first
on ``sys.path``, so ``PYTHONPATH=<another checkout> python <this checkout>/benchmarks/x.py``
runs *this* checkout's code, not the one ``PYTHONPATH`` names. A before/after measurement
made that way compares the new code with itself, silently (it happened once:
benchmarks/results/2026-11-27-quantize-once.md); the way to measure the other checkout is its
own copy of the script. :func:`warn_other_checkouts` says so in one line on stderr (rank 0 only).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
"""The ``megatron_ext`` package this process imported."""


def other_checkouts(here: Path, pythonpath: str) -> list[str]:
    """The entries of ``pythonpath`` that hold a ``megatron_ext`` package other than
    ``here`` (the imported one)."""
    out = []
    for entry in filter(None, pythonpath.split(os.pathsep)):
        package = Path(entry) / "megatron_ext"
        if (package / "__init__.py").is_file() and package.resolve() != here:
            out.append(entry)
    return out


def warn_other_checkouts() -> None:
    """One stderr line when ``PYTHONPATH`` names another checkout than the imported one."""
    others = other_checkouts(HERE, os.environ.get("PYTHONPATH", ""))
    if others and os.environ.get("RANK", "0") == "0":
        print(f"note: megatron_ext runs from {HERE.parent}, not from the checkout PYTHONPATH "
              f"names ({', '.join(others)}): a script's own checkout comes first; to run "
              "that one, run its copy of the script", file=sys.stderr)
