"""All-or-nothing output directories: a failed conversion leaves nothing behind."""

from __future__ import annotations

import os
import resource
import shutil
from contextlib import contextmanager

from megatron_ext.errors import UsageError
from megatron_ext.io import check_output, made_dirs


def check_new_output(out: str) -> None:
    """``--out`` must not exist yet (an empty directory is fine) and must be writable."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"--out: '{out}' already exists and is not empty")
    check_output(out, "--out")


@contextmanager
def atomic_output_dir(out: str):
    """Yield a temporary sibling of ``out``; it is renamed to ``out`` only if the block
    succeeds, and removed if it fails."""
    check_new_output(out)
    out = os.path.abspath(out)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.tmp-{os.getpid()}")
    with made_dirs(os.path.dirname(out)):
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(tmp, out)


def report_peak_memory() -> None:
    """Print this process' peak resident memory (what docs/convert.md quotes)."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"peak memory (max RSS of this process): {peak_kib / 1024:.0f} MiB", flush=True)
