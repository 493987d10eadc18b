"""STQuant's state update as one compiled CPU kernel (``cpu_step.cpp``, built at run time by
``torch.utils.cpp_extension``): per quantization block, decode the old ``m``, ``v`` codes,
run AdamW, find the block's new scale and encode at the new width — one read and one write
of the codes, the parameter and its gradient read once, the parameter written once; blocks
split over torch's intra-op threads (``at::parallel_for``), the loops left to gcc's
vectoriser (``-O3 -march=native``).

**Numerics**: the Triton kernel's (:mod:`.triton_step`), i.e. the torch path's op by op, with
``-ffp-contract=off`` so that the only fused multiply-adds are the explicit ones (ATen's
vectorised ``lerp`` and ``addcmul``). The new ``m``, ``v`` codes and scales are bit for bit
the torch path's; the parameter within one float32 ulp plus 2**-21 of its update (the
kernel's ``sqrt`` is correctly rounded, torch's CPU one is not always). The log ladder's rung
count inside an octave is exact: a table over the top 12 mantissa bits gives the count at the
bucket's start, and one comparison with the next cut finishes it (no bucket holds two cuts:
at 16 bits they are ``2**(1/2048)`` apart, more than a bucket's ``2**-12``).

**Choice** (``--stquant-cpu-kernel``): ``compiled``, ``torch`` or ``auto`` (compiled when the
kernel builds, else the torch path, said in one line). The build is cached on disk by torch
(``TORCH_EXTENSIONS_DIR``), one per kind of CPU: the first takes ~20 s of CPU, later
processes load it in 0.1-1 s.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ext.errors import UsageError
from megatron_ext.methods.stquant.quantizer import QState, empty_state, log_tables

__all__ = ["CHOICES", "kernel", "step"]

CHOICES = ("auto", "compiled", "torch")
"""``--stquant-cpu-kernel``'s values."""

SOURCE = Path(__file__).with_name("cpu_step.cpp")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
BUCKET_BITS = 12
"""Mantissa bits that index the rung table."""


def _cpu_tag() -> str:
    """A short digest of this CPU's feature flags: ``-march=native`` code built on one CPU
    may not run on another, so a shared extension cache keeps one build per kind of CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        text = platform.processor() or platform.machine()
    flags = next((line for line in text.splitlines() if line.startswith("flags")), text)
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _build():
    from torch.utils.cpp_extension import load_inline

    source = SOURCE.read_text(encoding="utf-8")
    return load_inline(name=f"megatron_ext_stquant_cpu_step_{_cpu_tag()}", cpp_sources=[source],
                       functions=["step"], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"])


@functools.cache
def kernel(choice: str):
    """The compiled module for ``--stquant-cpu-kernel choice``, or None for the torch path.
    Built (or loaded from torch's cache) once per process, saying so in one line; ``compiled``
    that does not build is a ``UsageError``, ``auto`` falls back to the torch path."""
    if choice not in CHOICES:
        raise UsageError(f"--stquant-cpu-kernel must be one of {', '.join(CHOICES)}, got {choice}")
    if choice == "torch":
        return None
    start = time.perf_counter()
    try:
        module = _build()
    except Exception as err:  # noqa: BLE001 (no compiler, no ninja, a failed build: say which)
        reason = (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]
        if choice == "compiled":
            raise UsageError(f"--stquant-cpu-kernel compiled: the C++ kernel does not build "
                             f"({reason})") from err
        _say(f"stquant: the CPU kernel does not build ({reason}); the CPU optimizer step runs "
             "the torch path (--stquant-cpu-kernel torch)")
        return None
    _say(f"stquant: CPU optimizer step = the fused C++ kernel (--stquant-cpu-kernel {choice}), "
         f"built or loaded in {time.perf_counter() - start:.1f} s")
    return module


def _say(line: str) -> None:
    """Print ``line`` once per run (rank 0)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


@functools.cache
def _rungs(bits: int) -> torch.Tensor:
    """The rungs the kernel decodes ``bits``-bit codes with: all of them at 4 / 8 bits; at 16
    the top octave's, ``rungs[K - r]`` for ``r < 2048``, from which every rung is a power-of-two
    multiple (``rungs[K - 2048 q - r] = 2**-q rungs[K - r]``, checked here): 8 KB instead of
    a 256 KB table to gather from."""
    rungs, _ = log_tables(bits, torch.device("cpu"))
    if bits != 16:
        return rungs
    top = rungs.numel() - 1
    octave = rungs[top - torch.arange(2048)]
    t = top - torch.arange(1, top + 1)
    if not torch.equal(torch.ldexp(octave[t % 2048], -(t // 2048).float()), rungs[1:]):
        raise RuntimeError("the 16-bit rungs are not power-of-two multiples of the top octave's")
    return octave


@functools.cache
def _ladder(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table, cuts)`` of the ``bits``-bit ladder: ``cuts`` with ``inf`` appended and
    ``table[i] = #{cuts <= 1 + i / 2**12}``; one placeholder each at 32 bits."""
    if bits == 32:
        return torch.zeros(1, dtype=torch.int32), torch.full((1,), float("inf"))
    _, cuts = log_tables(bits, torch.device("cpu"))
    starts = 1 + torch.arange(2 ** BUCKET_BITS, dtype=torch.float64) / 2 ** BUCKET_BITS
    table = (cuts.double()[None, :] <= starts[:, None]).sum(1).int()
    return table, torch.cat([cuts, cuts.new_full((1,), float("inf"))])


def step(module, p: torch.Tensor, grad: torch.Tensor, m: QState, v: QState, bits: int,
         scalars) -> tuple[QState, QState]:
    """Update the contiguous float32 CPU tensor ``p`` in place from ``grad`` and return the
    new ``m``, ``v`` at ``bits`` bits (``scalars``: an ``update.StepScalars``), through the
    built ``module`` (:func:`kernel`)."""
    nblocks = -(-(m.lead + m.numel) // m.block)
    m_new, v_new = empty_state(m, "linear", bits, nblocks), empty_state(v, "log", bits, nblocks)
    none = torch.empty(0)
    rungs = _rungs(m.bits) if m.bits != 32 else none
    table, cuts = _ladder(bits)
    s = scalars
    module.step(p, grad, m.codes.contiguous(), _scales(m), m.bits, v.codes.contiguous(),
                _scales(v), m_new.codes,
                _scales(m_new), v_new.codes, _scales(v_new), bits, rungs, table, cuts, m.lead,
                m.block, [s.decay, s.lerp_weight, s.beta2, s.one_minus_beta2, s.bias2_sqrt,
                          s.eps, s.neg_step_size])
    return m_new, v_new


def _scales(q: QState) -> torch.Tensor:
    return q.scales.contiguous() if q.scales is not None else torch.empty(0)
