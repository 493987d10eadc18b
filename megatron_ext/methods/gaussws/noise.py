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

**Codes.** An element is a 4-bit sign-magnitude code (bit 0: |R| = 1, bit 1: |R| = 2,
bit 3: negative, set only when |R| > 0); element ``k`` of a 32-bit word is its nibble
``k`` (bits 4k..4k+3), so 8 elements share a word (0.5 byte per element). The construction
above is word-parallel: element k's bits are the nibble-k bits of four random words
``A, B, C, D``, and shifts/ANDs of whole words evaluate all 8 elements at once.

**Counter-based randomness.** The four words of packed word ``q`` of full-tensor row ``i``
are one Philox4x32-10 block (Salmon et al. 2011, the paper's PRNG reference; identical to
Triton's ``tl.randint4x``) with counter ``i · ceil(N / 8) + q`` and a 64-bit key. So R of
element (i, j) of the full M x N weight depends only on (key, i, j, N): any slice — a TP
shard's rows or columns — is generated on its own and equals the full tensor's slice bit for
bit, and the backward pass regenerates the forward's R from the key alone.

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

PHILOX_ROUNDS = 10
"""Philox rounds (Random123's and Triton's default)."""

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_NIBBLE0 = 0x11111111  # bit 0 of every nibble
assert sys.byteorder == "little", "unpack reads packed int32 words byte by byte"
ELEMS_PER_WORD = 8
"""R codes per packed 32-bit word."""
CHUNK_WORDS = 1 << 17
"""Packed words generated per pass on the torch path (bounds its int64 temporaries)."""


def philox4x32(c0, c1, c2, c3, key: int, rounds: int = PHILOX_ROUNDS):
    """Philox4x32 on int64 tensors holding uint32 counters; ``key`` is a 64-bit int
    (low word k0, high word k1). Returns the four output words (int64, in [0, 2^32)).

    The 32 x 32 -> 64-bit products are int64 multiplications: a product of two values below
    2^32 fits in 64 bits, and torch's int64 multiply wraps modulo 2^64 (two's complement), so
    the result's bits are the unsigned product's (high word: ``>> 32`` then masked). The
    low words c1, c3 stay unmasked inside the loop: their stray high bits only reach c0, c2
    through XORs that are masked before the next multiply."""
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    for _ in range(rounds):
        pa, pb = c0 * _ROUND_A, c2 * _ROUND_B
        c0, c2 = ((pb >> 32) ^ c1 ^ k0) & _MASK32, ((pa >> 32) ^ c3 ^ k1) & _MASK32
        c1, c3 = pb, pa
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1 & _MASK32, c2, c3 & _MASK32


def encode(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Eq. 7-8: eight packed R codes from four random 32-bit words (int64 in, int64 out,
    same construction on every nibble; see the module docstring)."""
    t = a | (a >> 1)
    e1 = t & (t >> 2) & b
    cc = c & (c >> 1)
    e2 = ((b >> 2) | (b >> 3)) & cc & (cc >> 2) & d & (d >> 1) & (d >> 2) & ~b
    sign = (b >> 1) & (e1 | e2)
    return (e1 & _NIBBLE0) | ((e2 & _NIBBLE0) << 1) | ((sign & _NIBBLE0) << 3)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the same bits as int32."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def words_per_row(cols: int) -> int:
    """Packed words per row of a ``cols``-wide full tensor."""
    return -(-cols // ELEMS_PER_WORD)


def packed_noise(
    rows: torch.Tensor, word_start: int, n_words: int, full_cols: int, key: int
) -> torch.Tensor:
    """Packed R (int32, ``len(rows) x n_words``) of full-tensor rows ``rows`` (global row
    indices, int64) and packed-word columns ``word_start .. word_start + n_words - 1`` of a
    full tensor ``full_cols`` wide — the torch reference (the Triton kernel is bit-identical)."""
    out = torch.empty(len(rows), n_words, dtype=torch.int32, device=rows.device)
    q = torch.arange(word_start, word_start + n_words, dtype=torch.int64, device=rows.device)
    step = max(1, CHUNK_WORDS // max(n_words, 1))
    for lo in range(0, len(rows), step):
        counter = rows[lo : lo + step, None] * words_per_row(full_cols) + q
        zero = torch.zeros_like(counter)
        a, b, c, d = philox4x32(counter & _MASK32, counter >> 32, zero, zero, key)
        out[lo : lo + step] = _to_int32(encode(a, b, c, d))
    return out


@functools.lru_cache(maxsize=None)
def _byte_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """256 x 2 table: the R values of a byte's low and high nibble."""
    codes = torch.arange(256)
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=1)
    return ((nibbles & 3) * (1 - 2 * (nibbles >> 3))).to(dtype).to(device)


def unpack(packed: torch.Tensor, col_offset: int, n_cols: int, dtype: torch.dtype):
    """R values (``dtype``, ``rows x n_cols``) of packed words whose first word starts
    ``col_offset`` (0..7) elements before the first wanted column. A table lookup per byte
    (a little-endian int32 holds nibbles 0, 1 in its first byte, and so on)."""
    rows = packed.shape[0]
    index = packed.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    values = _byte_values(dtype, packed.device).index_select(0, index).view(rows, -1)
    return values[:, col_offset : col_offset + n_cols]


def noise_block(rows: torch.Tensor, col_start: int, n_cols: int, full_cols: int, key: int,
                dtype: torch.dtype = torch.float32, generate=None) -> torch.Tensor:
    """R of full-tensor rows ``rows`` x columns ``col_start .. col_start + n_cols - 1``
    (``generate``: :func:`packed_noise` by default, or the Triton kernel)."""
    word_start = col_start // ELEMS_PER_WORD
    n_words = words_per_row(col_start + n_cols) - word_start
    packed = (generate or packed_noise)(rows, word_start, n_words, full_cols, key)
    return unpack(packed, col_start - word_start * ELEMS_PER_WORD, n_cols, dtype)


def _mix64(z: int) -> int:
    """One splitmix64 output step (add the golden gamma, then its finaliser): a bijection."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class NoiseSeeds:
    """The seed hierarchy of §3.7: run seed -> per-site seed -> per-step Philox key."""

    run_seed: int
    """The run's seed (``--seed``); with the step number it is all a resume needs."""

    def site_seed(self, site_id: str) -> int:
        """The seed of one weight, from its global site id (``"L3.fc2"``): the same on every
        TP / DP rank and independent of which pipeline stage builds the layer."""
        digest = hashlib.blake2b(site_id.encode(), digest_size=8).digest()
        return _mix64(_mix64(self.run_seed & _MASK64) ^ int.from_bytes(digest, "little"))

    def key(self, site_id: str, step: int) -> int:
        """The Philox key of ``site_id`` at optimizer step ``step`` (every micro-batch of a
        step, forward and backward, uses it). Kept below 2^63 so a kernel takes it as int64."""
        return _mix64(self.site_seed(site_id) ^ _mix64(step)) >> 1
