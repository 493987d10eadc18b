"""A device profile from measured GEMM timings (``benchmarks/gpu_check.py --sections gemm``).

The measurement table is a list of rows, one per GEMM shape ``(m x k) @ (k x n)``::

    {"m": 8192, "k": 2048, "n": 5632, "bf16_s": 1.9e-4,
     "native": [{"a": "fp8_e4m3", "b": "fp8_e4m3", "gemm_s": 1.2e-4, "total_s": 3.1e-4}],
     "emulated": [{"a": "mxfp4", "b": "mxfp4", "total_s": 9.5e-4}]}

``bf16_s``: a BF16 matmul; ``native``: a real low-precision GEMM of already quantized operands
(``gemm_s``) and with both operands quantized from BF16 first (``total_s``); ``emulated``:
both operands fake-quantized, then the BF16 matmul. :func:`profile_from_gemm` turns it into a
:class:`~megatron_ext.precision.device_profile.DeviceProfile` (medians over the shapes):

* ``bf16_flops_per_s``: ``2·m·k·n / bf16_s``;
* a native format's rate: ``bf16_s / gemm_s`` of the pairs it appears in (the best pair);
  a format the base profile lists as native with the same bits and scaling (E5M2 beside a
  measured E4M3) takes the measured rate; the base's other native formats stay;
* ``quantize_s_per_element``: ``(total_s − gemm_s) / (m·k + k·n)`` of the native pairs;
* ``emulate_s_per_element``: ``(total_s − bf16_s) / (m·k + k·n)`` of the emulated pairs;
* ``bytes_per_s`` and ``nongemm_s_per_token_layer``: the base profile's.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from megatron_ext.formats import get_format
from megatron_ext.precision.device_profile import CLASS_KEY, DeviceProfile, checked


def _positive(row: dict, key: str, where: str) -> float:
    value = row.get(key)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def _signature(name: str) -> tuple:
    """What makes two formats one kernel's operands: bits and scaling."""
    fmt = get_format(name)
    return fmt.bits, fmt.scaling


def _rates(table: list[dict]) -> dict[str, float]:
    """Measured format -> rate vs BF16 (best pair, median over shapes)."""
    pairs: dict[tuple[str, str], list[float]] = {}
    for i, row in enumerate(table):
        bf16 = _positive(row, "bf16_s", f"row {i}")
        for entry in row.get("native", []):
            key = (entry["a"], entry["b"])
            pairs.setdefault(key, []).append(bf16 / _positive(entry, "gemm_s", f"row {i}"))
    rates: dict[str, float] = {}
    for (a, b), seen in pairs.items():
        rate = statistics.median(seen)
        for name in (a, b):
            rates[name] = max(rates.get(name, 0.0), rate)
    return rates


def _per_element(table: list[dict], kind: str, base: str) -> list[float]:
    """Per-element quantization seconds of every ``kind`` entry: ``(total_s − base) / (m·k +
    k·n)`` with ``base`` the entry's ``gemm_s`` or the row's ``bf16_s``."""
    out = []
    for i, row in enumerate(table):
        elements = row["m"] * row["k"] + row["k"] * row["n"]
        for entry in row.get(kind, []):
            reference = entry[base] if base in entry else row[base]
            out.append(max(0.0, _positive(entry, "total_s", f"row {i}") - reference) / elements)
    return out


def profile_from_gemm(table: list[dict], base: DeviceProfile, name: str) -> DeviceProfile:
    """The device profile the measured ``table`` gives (module docstring), the rest from
    ``base``; ``ValueError`` for an empty or malformed table."""
    if not isinstance(table, list) or not table:
        raise ValueError("the GEMM measurement table is empty")
    try:
        flops = statistics.median(2.0 * r["m"] * r["k"] * r["n"] / _positive(r, "bf16_s", "row")
                                  for r in table)
        rates = _rates(table)
        quantize = _per_element(table, "native", "gemm_s")
        emulate = _per_element(table, "emulated", "bf16_s")
    except (KeyError, TypeError) as err:
        raise ValueError(f"malformed GEMM measurement row: {err!r}") from None
    measured = {_signature(f): r for f, r in rates.items()}
    native = dict(rates)
    for key, rate in base.native:
        if key not in native:
            same = None if key.startswith(CLASS_KEY) else measured.get(_signature(key))
            native[key] = rate if same is None else same
    return checked(dataclasses.replace(
        base, name=name, bf16_flops_per_s=flops, native=tuple(native.items()),
        quantize_s_per_element=statistics.median(quantize) if quantize
        else base.quantize_s_per_element,
        emulate_s_per_element=statistics.median(emulate) if emulate
        else base.emulate_s_per_element,
        source=f"measured: gpu_check gemm, {len(table)} shapes (medians); base {base.name}"))


def measurement_base(device_name: str | None) -> DeviceProfile:
    """The profile a measurement on ``device_name`` starts from: its built-in one (H100,
    H200, B200), else H100's numbers with no native format (only what is measured is)."""
    from megatron_ext.precision.device_profile import PROFILES, infer

    base = infer(device_name)
    return base if base.name != "nominal" else dataclasses.replace(PROFILES["h100"], native=())
