"""An independent float64 re-implementation of the formats, for the tests.

Written from the definitions, not from the package: element grids are enumerated value by
value, rounding picks the nearest grid point with ties to the even code by search, block
amaxes come from zero-padded numpy reshapes, and every float32 operation of the package is
mirrored as "exact float64 operation, then one rounding to float32" (exact for products and
quotients of float32 values: 53 >= 2 * 24 + 2 makes the double rounding innocuous).
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch

# name -> ("float", exponent bits, mantissa bits, max) | ("int", bits, max)
ELEMENT_SPECS = {
    "fp8_e4m3": ("float", 4, 3, 448.0),
    "fp8_e5m2": ("float", 5, 2, 57344.0),
    "fp6_e3m2": ("float", 3, 2, 28.0),
    "fp6_e2m3": ("float", 2, 3, 7.5),
    "fp4_e2m1": ("float", 2, 1, 6.0),
    "int8": ("int", 8, 127.0),
    "int4": ("int", 4, 7.0),
}
ALIASES = {
    "mxfp8": "fp8_e4m3@mx32",
    "mxfp8_e5m2": "fp8_e5m2@mx32",
    "mxfp6_e3m2": "fp6_e3m2@mx32",
    "mxfp6_e2m3": "fp6_e2m3@mx32",
    "mxfp4": "fp4_e2m1@mx32",
    "nvfp4": "fp4_e2m1@nv16",
}


def grid(element: str) -> np.ndarray:
    """All non-negative finite values of an element type, ascending (index = code)."""
    spec = ELEMENT_SPECS[element]
    if spec[0] == "int":
        return np.arange(0.0, spec[2] + 1.0)
    _, ebits, mbits, max_ = spec
    bias = 2 ** (ebits - 1) - 1
    values = [k / 2**mbits * 2.0 ** (1 - bias) for k in range(2**mbits)]  # zero + subnormals
    for e in range(1 - bias, 2**ebits):
        values += [(1 + k / 2**mbits) * 2.0**e for k in range(2**mbits)]
    return np.array([v for v in values if v <= max_])


def round_to_grid(v: np.ndarray, g: np.ndarray, mode: str = "nearest") -> np.ndarray:
    """Round finite ``v`` onto ``±g`` with saturation: nearest (ties to even code),
    or ``"down"`` / ``"up"`` in magnitude-independent direction (toward -inf / +inf)."""
    a = np.minimum(np.abs(v), g[-1])
    hi_idx = np.clip(np.searchsorted(g, a, side="left"), 1, len(g) - 1)
    lo, hi = g[hi_idx - 1], g[hi_idx]
    if mode == "nearest":
        pick_hi = (hi - a < a - lo) | ((hi - a == a - lo) & (hi_idx % 2 == 0))
        mag = np.where(a == lo, lo, np.where(pick_hi, hi, lo))
        return np.copysign(mag, v)
    toward_hi = (mode == "up") == (v >= 0)
    mag = np.where((a == lo) | ~toward_hi, lo, hi)
    mag = np.where(a == hi, hi, mag)
    return np.copysign(mag, v)


class Work:
    """The package's work precision: float32 (P=24) or float64 (P=53)."""

    def __init__(self, dtype: torch.dtype):
        self.p = 53 if dtype == torch.float64 else 24
        self.tiny = 2.0**-1022 if self.p == 53 else 2.0**-126

    def fl(self, a):
        """One rounding to the work precision."""
        a = np.asarray(a, dtype=np.float64)
        return a if self.p == 53 else a.astype(np.float32).astype(np.float64)

    def truncate_significand(self, d: np.ndarray, bits: int) -> np.ndarray:
        """Round positive normal ``d`` toward zero to ``bits`` significant bits."""
        m, e = np.frexp(d)
        return np.ldexp(np.floor(np.ldexp(m, bits)), e - bits)


def parse(name: str):
    """-> (element, kind, rows, cols, stochastic) from a format name."""
    name = name.strip().lower()
    stochastic = name.endswith("+sr")
    name = name.removesuffix("+sr")
    name = ALIASES.get(name, name)
    element, _, scaling = name.partition("@")
    scaling = scaling or "tensor"
    m = re.fullmatch(r"(none|tensor|row|tile|block|mx|nv)(\d*)", scaling)
    kind, size = m.group(1), int(m.group(2) or {"mx": 32, "nv": 16}.get(m.group(1), 0))
    rows, cols = {
        "none": (None, None), "tensor": (None, None), "row": (1, None),
        "tile": (1, size), "block": (size, size), "mx": (1, size), "nv": (1, size),
    }[kind]  # fmt: skip
    return element, kind, rows, cols, stochastic


def emax(element: str) -> int:
    return math.floor(math.log2(ELEMENT_SPECS[element][-1]))


def block_factors(x2: np.ndarray, name: str, dtype: torch.dtype):
    """Per-element (quant, dequant) factors for a 2-D float64 array (NaN/inf ignored)."""
    element, kind, rows, cols, _ = parse(name)
    work, max_ = Work(dtype), ELEMENT_SPECS[element][-1]
    R, C = x2.shape
    rows, cols = rows or R, cols or C
    finite = np.where(np.isfinite(x2), np.abs(x2), 0.0)
    pr, pc = -(-R // rows) * rows, -(-C // cols) * cols
    padded = np.zeros((pr, pc))
    padded[:R, :C] = finite
    amax = padded.reshape(pr // rows, rows, pc // cols, cols).max(axis=(1, 3))
    if kind == "none":
        q, d = np.ones_like(amax), np.ones_like(amax)
    elif kind in ("tensor", "row", "tile", "block"):
        d = work.fl(amax / max_)
        sig = _significant_bits(max_)
        d = np.where(
            d < work.tiny,
            work.tiny,
            work.truncate_significand(np.maximum(d, work.tiny), work.p - sig),
        )
        q = work.fl(1.0 / d)
    elif kind == "mx":
        safe = np.where(amax > 0, amax, 1.0)
        s = np.where(amax > 0, np.frexp(safe)[1] - 1 - emax(element), -127)
        s = np.clip(s, -127, 127).astype(np.float64)
        q, d = 2.0**-s, 2.0**s
    else:  # nv
        t = max(work.fl(finite.max() / (448.0 * max_)), work.tiny * 2.0**6)
        b = np.clip(work.fl(work.fl(amax / max_) / t), 2.0**-6, 448.0)
        b = round_to_grid(b, grid("fp8_e4m3"))
        q, d = work.fl(work.fl(1.0 / t) / b), work.fl(t * b)
    expand = lambda f: np.repeat(np.repeat(f, rows, 0), cols, 1)[:R, :C]
    return expand(q), expand(d)


def _significant_bits(v: float) -> int:
    m = math.frexp(v)[0]
    while m != int(m):
        m *= 2
    return int(m).bit_length()


def fake_quant_ref(
    x: torch.Tensor, name: str, axis: int = -1, mode: str = "nearest"
) -> torch.Tensor:
    """Reference fake quantization (nearest, or the "down"/"up" neighbour for SR checks)."""
    element, *_ = parse(name)
    if element in ("fp32", "bf16", "fp16"):
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[element]
        return x.to(dt).to(x.dtype)
    work = Work(x.dtype)
    moved = x.movedim(axis, -1)
    x2 = moved.reshape(-1, moved.shape[-1]).double().numpy()
    qf, df = block_factors(x2, name, x.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        v = work.fl(np.where(np.isfinite(x2), x2, 0.0) * qf)
        y = work.fl(round_to_grid(v, grid(element), mode) * df)
    y = np.where(np.isfinite(x2), np.copysign(y, x2), x2)
    out = torch.from_numpy(y).to(x.dtype).view(moved.shape)
    return out.movedim(-1, axis).contiguous()
