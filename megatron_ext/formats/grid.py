"""Kernel-grid arithmetic on the host, in plain Python.

In triton 3.x ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: a
call from host code unwraps each argument first. A two-pass quantizer call makes ten of
them; done here, its host time went from 31 to 17 µs on CPU, and a GPU step whose time is
the host's pays each (benchmarks/results/2026-11-27-host-time.md).
"""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of integers."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1)."""
    return 1 << (n - 1).bit_length()
