"""App. D's bound against numbers worked out by hand for a small Llama-shaped layer."""

from __future__ import annotations

from itertools import combinations

import pytest

from megatron_ext.methods.gnmr.memory import (
    ActivationLayout, peak_extra_bytes, saved_elements, site_bits, unit_extra_bytes)
from megatron_ext.precision.cost import ModelShape
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats

# hidden 64, 4 heads of 16, 2 KV groups, SwiGLU 128: K = 64 (qkv, proj, fc1), 128 (fc2)
SHAPE = ModelShape(2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, swiglu=True, tokens=1)
TP2 = ActivationLayout(tokens=32, tp=2, sequence_parallel=False)
TP2_SP = ActivationLayout(tokens=32, tp=2, sequence_parallel=True)


def test_saved_elements_by_hand():
    # column-parallel: T x K (replicated input); row-parallel: T x K/t
    assert ([saved_elements(SHAPE, s, TP2) for s in ("qkv", "proj", "fc1", "fc2")] ==
            [32 * 64, 32 * 32, 32 * 64, 32 * 64])
    # sequence parallel: column-parallel sites keep T/t rows
    assert ([saved_elements(SHAPE, s, TP2_SP) for s in ("qkv", "proj", "fc1", "fc2")] ==
            [16 * 64, 32 * 32, 16 * 64, 32 * 64])


def test_unit_extra_bytes_by_hand():
    # FP4 (1x128 tiles: 4 + 32/128 = 4.25 bits) -> FP8 tiles (8.25 bits): 4 bits = 0.5 byte
    bits = {f"L0.{s}": site_bits(UNIFORM["fp4"], "auto") for s in ("qkv", "proj", "fc1", "fc2")}
    assert bits["L0.fc1"] == (4.25, 8.25)
    assert unit_extra_bytes(SHAPE, TP2, "L0", bits) == (2048 + 1024 + 2048 + 2048) * 0.5
    assert unit_extra_bytes(SHAPE, TP2, "L0.fc2", bits) == 2048 * 0.5
    # FP8 tiles -> BF16: 7.75 bits; a site missing from ``bits`` is already high: 0
    fp8 = {"L1.qkv": site_bits(UNIFORM["fp8"], "auto")}
    assert unit_extra_bytes(SHAPE, TP2_SP, "L1", fp8) == 1024 * 7.75 / 8
    # passthrough x: the run's dtype (16 bits) both before and after
    assert site_bits(SiteFormats("none", "fp4_e2m1@block128", "bf16"), "auto") == (16.0, 16.0)


def test_peak_bound_by_hand():
    # extras 100, 300, 200 bytes; maxO 2; 3 micro-batches in flight
    bound = peak_extra_bytes([100.0, 300.0, 200.0], budget=2, in_flight=3)
    assert (bound.topk, bound.loose) == (3 * 500.0, 3 * 2 * 300.0)
    # a budget above the stage's unit count is capped by it
    bound = peak_extra_bytes([100.0, 300.0, 200.0], budget=5, in_flight=3)
    assert (bound.topk, bound.loose) == (3 * 600.0, 3 * 3 * 300.0)
    assert peak_extra_bytes([100.0], budget=0, in_flight=4).topk == 0.0
    assert peak_extra_bytes([], budget=3, in_flight=4).loose == 0.0


def test_bound_covers_every_promoted_set():
    """Eq. 61 for every set of at most maxO units stays under the top-K form of eq. 62."""
    extras = [7.0, 1.0, 5.0, 5.0, 2.0]
    bound = peak_extra_bytes(extras, budget=2, in_flight=1)
    worst = max(sum(c) for k in range(3) for c in combinations(extras, k))
    assert worst == pytest.approx(bound.topk) and bound.topk <= bound.loose
