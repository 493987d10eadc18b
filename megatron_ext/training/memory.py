"""Peak memory since the last reading, on every device: ``mem_gib`` of ``metrics.jsonl``.

* **CUDA**: ``torch.cuda.max_memory_allocated`` (bytes held by tensors, the caching
  allocator's reserve and the CUDA context not included), then
  ``torch.cuda.reset_peak_memory_stats``.
* **CPU** (Linux): the process's peak resident set size, ``VmHWM`` of ``/proc/self/status``,
  then ``5`` written to ``/proc/self/clear_refs``, which sets the peak back to the current
  resident size (Linux >= 4.0). This is the whole process (interpreter, libraries, every
  tensor), as GNU time's ``%M`` measures it, so a CPU reading is comparable to ``%M`` but
  not to a CUDA one. The reset is the kernel's one peak: ``getrusage`` and so ``%M`` of a
  run that logs ``mem_gib`` report only the peak since the last reading.
* Elsewhere (no ``/proc``): no reading (``None``); the metric is then left out.

A reading covers everything between two readings — the logged steps and the hooks around
them (a SNIP refresh's observed passes before its step, a PGQ profile) — so a regression
in any of them shows in the step that is logged next.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

GIB = 2 ** 30
STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"


def _peak_rss_bytes() -> int | None:
    """``VmHWM`` of this process in bytes; None where /proc does not tell."""
    try:
        with open(STATUS, encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Peak RSS := current RSS; False where the kernel does not allow it."""
    try:
        with open(CLEAR_REFS, "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory since the last :meth:`read` (module docstring)."""

    def __init__(self, cuda: bool | None = None):
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        """Read the CUDA allocator (True) or the process's RSS (False)."""
        self.resettable = True
        """Whether the CPU peak can be reset (else a reading is the peak since start-up)."""
        self.reset()

    def reset(self) -> None:
        """Start a new interval now."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.resettable = _reset_peak_rss()

    def read(self) -> float | None:
        """GiB at the peak since the last reading (or :meth:`reset`); starts the next
        interval. None where nothing can be read."""
        if self.cuda:
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _peak_rss_bytes()
        self.reset()
        return None if peak is None else peak / GIB

    def metrics(self) -> dict:
        """``{"mem_gib": peak}`` for a metrics record; ``{}`` without a reading."""
        peak = self.read()
        return {} if peak is None else {"mem_gib": peak}


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (None where the C library has none: musl, macOS, Windows)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Give the C heap's free pages back to the kernel (glibc ``malloc_trim(0)``) on CPU.

    glibc serves allocations under its mmap threshold (which grows to 32 MiB as large
    blocks are freed) from a heap whose freed chunks stay resident, so a phase that makes
    many short-lived tensors of varied sizes (a SNIP refresh's float64 error products) leaves
    RSS well above its live memory. Called between such tensors it keeps RSS near live
    memory, as the CUDA allocator's ``max_memory_allocated`` counts it. A no-op with CUDA
    (the heap is not where the tensors are) or without glibc."""
    trim = None if torch.cuda.is_available() else _malloc_trim()
    if trim is not None:
        trim(0)
