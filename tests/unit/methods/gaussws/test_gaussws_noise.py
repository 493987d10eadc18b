"""R's generator: SplitMix64 against its published answers and a Python reference, eq. 8
exactly (all bit patterns) and statistically (10^7 draws), codes, slices of the stream, seeds."""

import itertools
import math

import pytest
import torch

from megatron_ext.methods.gaussws import noise
from megatron_ext.methods.gaussws.noise import NoiseSeeds

EQ8 = {-2: 3 / 2048, -1: 9 / 64, 0: 1 - 18 / 64 - 6 / 2048, 1: 9 / 64, 2: 3 / 2048}


_M64 = (1 << 64) - 1


def _splitmix64(seed: int, n: int) -> list[int]:
    """The sequential generator in Python integers (Vigna's splitmix64.c): n outputs."""
    out, state = [], seed
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & _M64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        out.append(z ^ (z >> 31))
    return out


def test_splitmix64_known_answers():
    """Seed 1234567's first outputs, as published (Rosetta Code, Splitmix64)."""
    expected = [6457827717110365317, 3203168211198807973, 9817491932198370423,
                4593380528125082431, 16408922859458223821]
    assert _splitmix64(1234567, 5) == expected
    got = noise.random_words(torch.tensor([0]), 0, 5, 20, key=1234567)[0]
    assert [int(v) & _M64 for v in got] == expected


@pytest.mark.parametrize("key", [0, 1, 2**62 + 12345, 2**63 - 1])
def test_counter_is_row_times_draws_per_row_plus_draw(key):
    """Draw q of row i is output i · ceil(N / 4) + q of the sequential generator."""
    rows, full_cols = torch.tensor([0, 3, 7]), 37  # 10 draws per row
    words = noise.random_words(rows, 2, 6, full_cols, key)
    stream = _splitmix64(key, 80)
    for r, row in enumerate(rows.tolist()):
        assert [int(v) & _M64 for v in words[r]] == stream[row * 10 + 2 : row * 10 + 8]


def _scalar_code(bits):
    """Eq. 7-8 for one element, written out bit by bit (A0..A3 B0..B3 C0..C3 D0..D2)."""
    a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2 = bits
    e1 = (a0 | a1) & (a2 | a3) & b0
    e2 = (b2 | b3) & c0 & c1 & c2 & c3 & d0 & d1 & d2 & (1 - b0)
    return (e1 + 2 * e2) * (-1 if b1 and (e1 or e2) else 1)


def test_every_bit_pattern_gives_eq8_exactly():
    """All 2^16 patterns of an element's 16 bits (D3 unused): the value table equals the
    bit-by-bit formula, its counts are eq. 8's probabilities times 2^16, and the word-parallel
    encode gives the same code in every nibble position."""
    patterns = list(itertools.product((0, 1), repeat=16))
    table = noise.value_table(torch.int64, torch.device("cpu"))
    index = [sum(bit << k for k, bit in enumerate(p)) for p in patterns]
    assert [int(table[i]) for i in index] == [_scalar_code(p[:15]) for p in patterns]
    counts = {v: int((table == v).sum()) for v in EQ8}
    assert counts == {v: round(p * 2**16) for v, p in EQ8.items()}
    p = torch.arange(1 << 16)
    a, b, c, d = ((p >> k) & 15 for k in (0, 4, 8, 12))
    codes = noise.encode(a << 20, b << 20, c << 20, d << 20) >> 20  # nibble 5 of the words
    assert torch.equal(noise.code_value(codes), table)
    assert set(codes.unique().tolist()) == {0, 1, 2, 9, 10}  # sign only with |R| > 0


def test_frequencies_within_3_sigma_over_1e7_draws():
    r = noise.noise_block(torch.arange(1250), 0, 8000, 8000, key=20240607)
    n = r.numel()
    assert n >= 10**7
    for v, p in EQ8.items():
        count = int((r == v).sum())
        assert abs(count - n * p) <= 3 * math.sqrt(n * p * (1 - p)), (v, count, n * p)
    variance = sum(p * v * v for v, p in EQ8.items())
    assert abs(r.double().mean().item()) <= 3 * math.sqrt(variance / n)
    # neighbours along a row / down a column / across words are uncorrelated
    rd = r.double()
    for a, b in [(rd[:, :-1], rd[:, 1:]), (rd[:-1], rd[1:]), (rd[:, :-8], rd[:, 8:])]:
        corr = ((a * b).mean() - a.mean() * b.mean()) / variance
        assert abs(corr.item()) <= 4 / math.sqrt(a.numel())


def test_any_slice_equals_the_full_stream():
    key, full = 77, noise.noise_block(torch.arange(40), 0, 203, 203, key=77)
    rows = torch.tensor([39, 0, 17, 18, 5])
    for c0, width in [(0, 203), (3, 100), (101, 102), (200, 3), (96, 8), (13, 1)]:
        part = noise.noise_block(rows, c0, width, 203, key)
        assert torch.equal(part, full[rows][:, c0 : c0 + width])


def test_keys_and_streams_differ_where_they_should():
    seeds = NoiseSeeds(1234)
    assert seeds.key("L0.fc2", 7) == NoiseSeeds(1234).key("L0.fc2", 7)  # deterministic
    keys = {seeds.key(f"L{i}.{s}", t) for i in range(4) for s in ("proj", "fc2") for t in range(3)}
    keys.add(NoiseSeeds(1235).key("L0.fc2", 0))
    assert len(keys) == 25 and all(0 <= k < 2**63 for k in keys)
    rows = torch.arange(64)
    a = noise.noise_block(rows, 0, 64, 64, seeds.key("L0.fc2", 0))
    b = noise.noise_block(rows, 0, 64, 64, seeds.key("L0.fc2", 1))
    assert (a != b).float().mean() > 0.3  # a different step draws different noise
