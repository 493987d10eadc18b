"""The noise basis R of GaussWS (paper §3.3-3.4, §3.7): R ≈ round(N(0, 1) / 2) from random bits.

**Distribution (eq. 7-8).** R takes the values -2..2 with

    P(±1) = (3/4)^2 · 2^-2 = 9/64 ≈ 1/7.1      P(±2) = 3/4 · 2^-9 = 3/2048 ≈ 1/682.7
    P(0)  = 1 - 18/64 - 6/2048 ≈ 0.716          (mean 0, variance 75/256 ≈ 0.293)

built from independent fair bits with AND (P(a & b) = P(a) P(b)) and OR (P(a | b) =
P(a) + P(b) - P(a) P(b)) only — no floating point, no Box-Muller. Per element, from 16
random bits ``A0..A3 B0..B3 C0..C3 D0..D3`` (D3 unused):

    E1 = (A0 | A1) & (A2 | A3) & B0                               P = 3/4 · 3/4 · 1/2 = 9/32
    E2 = (B2 | B3) & C0 & C1 & C2 & C3 & D0 & D1 & D2 & ~B0       P = 3/4 · 2^-7 · 1/2
    |R| = 1 if E1, 2 if E2 (never both: B0 vs ~B0), else 0;  sign = B1

Eq. 8's exact probabilities follow (each magnitude splits evenly over the sign bit).
:func:`encode` evaluates this on nibbles (a 4-bit sign-magnitude code: bit 0 |R| = 1,
bit 1 |R| = 2, bit 3 negative, set only when |R| > 0), word-parallel: on four words it
encodes every nibble position at once. The torch path applies it once, to all 2^16 bit
patterns, and looks each element's 16 bits up in that table (:func:`value_table`): one
gather instead of ~25 elementwise passes; the Triton kernel evaluates it per element.

**Counter-based randomness: SplitMix64.** Element (i, j) of the full M x N weight takes
its 16 bits from lane ``j mod 4`` (bits 16·(j mod 4) ..) of one 64-bit SplitMix64 output
(Steele, Lea & Flood 2014, the generator of Java's ``SplittableRandom``; passes BigCrush):

    z = key + (n + 1) · γ   (mod 2^64),   n = i · ceil(N / 4) + j div 4,   γ = 0x9E3779B97F4A7C15
    z = (z ^ z >> 30) · 0xBF58476D1CE4E5B9;  z = (z ^ z >> 27) · 0x94D049BB133111EB;  z ^ z >> 31

(the n-th output of the sequential generator seeded with ``key``). So R(i, j) depends only
on (key, i, j, N): any slice — a TP shard's rows or columns — is generated on its own and
equals the full tensor's slice bit for bit, and the backward pass regenerates the forward's
R from the key alone. In torch the arithmetic is int64 (multiplication and addition wrap
modulo 2^64 with the unsigned result's bits; the logical shifts are arithmetic shifts
masked): 12 elementwise passes over a quarter of the elements, where Philox4x32-10 took ~100
over an eighth.

**Seeds (§3.7).** run seed -> per-site seed (a hash of the run seed and the global site id,
so each pipeline stage derives its own layers' seeds independently) -> per-step key (a hash
of the site seed and the optimizer step, the same for every micro-batch of a step: gradient
accumulation sees one frozen sample, the "virtual batch"; resuming at step t regenerates the
same keys). All TP and DP ranks of a site use the same key: they hold the same weight.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
"""SplitMix64's increment (the golden ratio times 2^64, odd)."""
MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
"""SplitMix64's two finaliser multipliers."""
SHIFTS = (30, 27, 31)
"""SplitMix64's three finaliser xor-shifts."""
ELEMS_PER_DRAW = 4
"""Elements per 64-bit output (16 bits each)."""
_NIBBLE0 = 0x11111111  # bit 0 of every nibble
assert sys.byteorder == "little", "lane k of an int64 viewed as 16-bit words is bits 16k.."


def as_int64(v: int) -> int:
    """A 64-bit pattern as the int64 with the same bits."""
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser, in place on an int64 tensor holding 64-bit patterns."""
    tmp = torch.empty_like(z)
    for shift, mult in zip(SHIFTS, (*MIX, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        z ^= tmp.bitwise_and_((1 << (64 - shift)) - 1)  # the logical shift of the pattern
        if mult is not None:
            z *= as_int64(mult)
    return z


def draws_per_row(cols: int) -> int:
    """64-bit outputs per row of a ``cols``-wide full tensor."""
    return -(-cols // ELEMS_PER_DRAW)


def random_words(rows: torch.Tensor, start: int, count: int, full_cols: int, key: int):
    """The SplitMix64 outputs (int64 bits, ``len(rows) x count``) of full-tensor rows ``rows``
    (int64) and draws ``start .. start + count - 1`` of each row (module docstring)."""
    q = torch.arange(start, start + count, dtype=torch.int64, device=rows.device)
    row_part = rows * as_int64(draws_per_row(full_cols) * GAMMA)
    col_part = q.mul_(as_int64(GAMMA)).add_(as_int64(key + GAMMA))
    return mix64(torch.add(row_part[:, None], col_part))


def encode(a, b, c, d):
    """Eq. 7-8 on every nibble of four random words (ints or int64 tensors): the 4-bit codes
    (module docstring), nibble k of the result from nibble k of ``a``, ``b``, ``c``, ``d``."""
    t = a | (a >> 1)
    e1 = t & (t >> 2) & b
    cc = c & (c >> 1)
    e2 = ((b >> 2) | (b >> 3)) & cc & (cc >> 2) & d & (d >> 1) & (d >> 2) & ~b
    sign = (b >> 1) & (e1 | e2)
    return (e1 & _NIBBLE0) | ((e2 & _NIBBLE0) << 1) | ((sign & _NIBBLE0) << 3)


def code_value(code):
    """R of a 4-bit code."""
    return (code & 3) * (1 - 2 * ((code >> 3) & 1))


@functools.lru_cache(maxsize=None)
def value_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """R of each of the 2^16 bit patterns ``A0..A3 B0..B3 C0..C3 D0..D3`` (bit 0 first)."""
    p = torch.arange(1 << 16)
    code = encode(p & 15, (p >> 4) & 15, (p >> 8) & 15, (p >> 12) & 15)
    return code_value(code).to(dtype).to(device)


def noise_block(rows: torch.Tensor, col_start: int, n_cols: int, full_cols: int, key: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """R (``dtype``) of full-tensor rows ``rows`` (int64) x columns ``col_start ..
    col_start + n_cols - 1`` of a full tensor ``full_cols`` wide — the torch reference (the
    Triton kernel is bit-identical)."""
    first = col_start // ELEMS_PER_DRAW
    count = draws_per_row(col_start + n_cols) - first
    lanes = random_words(rows, first, count, full_cols, key).view(torch.uint16)
    offset = col_start - first * ELEMS_PER_DRAW
    index = lanes[:, offset : offset + n_cols].to(torch.int32)
    return value_table(dtype, rows.device).index_select(0, index.view(-1)).view(index.shape)


def _mix64(z: int) -> int:
    """One splitmix64 output step (add the golden gamma, then its finaliser): a bijection."""
    z = (z + GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * MIX[0]) & _MASK64
    z = ((z ^ (z >> 27)) * MIX[1]) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class NoiseSeeds:
    """The seed hierarchy of §3.7: run seed -> per-site seed -> per-step key."""

    run_seed: int
    """The run's seed (``--seed``); with the step number it is all a resume needs."""

    def site_seed(self, site_id: str) -> int:
        """The seed of one weight, from its global site id (``"L3.fc2"``): the same on every
        TP / DP rank and independent of which pipeline stage builds the layer."""
        digest = hashlib.blake2b(site_id.encode(), digest_size=8).digest()
        return _mix64(_mix64(self.run_seed & _MASK64) ^ int.from_bytes(digest, "little"))

    def key(self, site_id: str, step: int) -> int:
        """The SplitMix64 key of ``site_id`` at optimizer step ``step`` (every micro-batch of
        a step, forward and backward, uses it). Kept below 2^63 so a kernel takes it as int64."""
        return _mix64(self.site_seed(site_id) ^ _mix64(step)) >> 1
