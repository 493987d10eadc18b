"""R's generator: Philox against Random123's published answers, eq. 8 exactly (all bit
patterns) and statistically (10^7 draws), codes, slices of the counter-based stream, seeds."""

import itertools
import math

import pytest
import torch

from megatron_ext.methods.gaussws import noise
from megatron_ext.methods.gaussws.noise import NoiseSeeds

EQ8 = {-2: 3 / 2048, -1: 9 / 64, 0: 1 - 18 / 64 - 6 / 2048, 1: 9 / 64, 2: 3 / 2048}


def _t(v):
    return torch.tensor([v], dtype=torch.int64)


# Random123 kat_vectors, philox4x32 with 10 rounds: (counter, key) -> output
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]  # fmt: skip


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_matches_random123_known_answers(counter, key, expected):
    out = noise.philox4x32(*map(_t, counter), key[0] | key[1] << 32)
    assert tuple(int(x) for x in out) == expected


def _scalar_code(bits):
    """Eq. 7-8 for one element, written out bit by bit (A0..A3 B0..B3 C0..C3 D0..D2)."""
    a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2 = bits
    e1 = (a0 | a1) & (a2 | a3) & b0
    e2 = (b2 | b3) & c0 & c1 & c2 & c3 & d0 & d1 & d2 & (1 - b0)
    return (e1 + 2 * e2) * (-1 if b1 and (e1 or e2) else 1)


def test_every_bit_pattern_gives_eq8_exactly():
    """All 2^15 patterns of the 15 bits one element uses, placed in nibble 5 of the four
    words: the code counts are eq. 8's probabilities times 2^15, and each code equals the
    bit-by-bit formula."""
    patterns = list(itertools.product((0, 1), repeat=15))
    bits = torch.tensor(patterns, dtype=torch.int64)
    words = []
    for w in range(4):
        nib = bits[:, 4 * w : 4 * w + 4]
        weights = torch.tensor([1, 2, 4, 8][: nib.shape[1]])
        words.append((nib * weights).sum(1) << 20)
    packed = noise._to_int32(noise.encode(*words))
    r = noise.unpack(packed[:, None], 5, 1, torch.int64)[:, 0]
    assert r.tolist() == [_scalar_code(p) for p in patterns]
    counts = {v: int((r == v).sum()) for v in EQ8}
    assert counts == {v: round(p * 2**15) for v, p in EQ8.items()}
    codes = (packed >> 20) & 0xF
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


def test_generation_is_independent_of_the_chunk_size(monkeypatch):
    rows = torch.arange(50)
    whole = noise.packed_noise(rows, 2, 30, 400, key=5)
    monkeypatch.setattr(noise, "CHUNK_WORDS", 64)  # two rows per chunk
    assert torch.equal(noise.packed_noise(rows, 2, 30, 400, key=5), whole)


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
