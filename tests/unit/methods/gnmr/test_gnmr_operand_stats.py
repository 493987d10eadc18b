"""Autoswitch's operand statistics: the four sums against float64 brute force, the per-unit
worst operand, and the hooks' operands (each along its GEMM's axis) on a hand-made linear."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_ext.formats import fake_quant
from megatron_ext.methods.gnmr.operand_stats import (OperandStatsCollector, operand_sums,
                                                     unit_stats)
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.sites import OPERANDS, all_site_ids


def _brute(t, q) -> list[float]:
    t, q = np.asarray(t, np.float64).ravel(), np.asarray(q, np.float64).ravel()
    under = sum(1 for a, b in zip(t, q) if a != 0 and b == 0)
    return [under, sum((a - b) ** 2 for a, b in zip(t, q)), sum(a * a for a in t), len(t)]


def test_operand_sums_by_hand():
    t = torch.tensor([0.0, 1.0, -2.0, 0.5])
    q = torch.tensor([0.0, 0.0, -2.0, 1.0])
    assert operand_sums(t, q).tolist() == [1.0, 1.25, 5.25, 4.0]
    t, q = torch.randn(7, 5), torch.randn(7, 5).mul(0.1).round()
    assert operand_sums(t, q).tolist() == pytest.approx(_brute(t, q), rel=1e-12)


def test_unit_stats_takes_the_worst_operand_of_each_unit():
    sites = all_site_ids(2)  # 8 sites, 2 blocks
    sums = np.zeros((8, 6, 4))
    sums[..., 3] = 100.0  # 100 elements everywhere
    sums[1, 2] = [30, 0.5, 50, 100]   # L0.proj dgrad.dy: 30 % underflow, MSE 5e-3
    sums[2, 5] = [1, 2.0, 4, 100]     # L0.fc1 wgrad.x: MSE 2e-2, rel 0.5
    sums[6, 0] = [0, 0, 0, 0]         # an unmonitored operand (no elements) in L1
    stats = unit_stats(sums, sites, ["L0", "L1"], "block")
    assert stats.underflow_pct.tolist() == [30.0, 0.0]
    assert stats.mse.tolist() == [0.02, 0.0]
    assert stats.rel_mse.tolist() == [0.5, 0.0]
    per_site = unit_stats(sums, sites, sites, "site")
    assert per_site.underflow_pct[1] == 30.0 and per_site.mse[2] == 0.02
    sums[5, 1, 1] = np.nan
    assert np.isnan(unit_stats(sums, sites, ["L0", "L1"], "block").mse[1])


FORMATS = SiteFormats("fp4_e2m1@tile4", "fp4_e2m1@block4", "fp4_e2m1@tile4")


def _collector(formats=FORMATS):
    plans = SimpleNamespace(base=PrecisionPlan({"L0.qkv": formats}))
    return OperandStatsCollector(plans, ["L0.qkv"], ["L0"], "block")


def _pass(collector, x, w, dy):
    """What a quantized linear does: forward (hooked), then backward with ``dy``."""
    module = SimpleNamespace(observer=None, weight=w)
    x = x.requires_grad_()
    out = x @ w.t()
    collector._forward("L0.qkv", module, (x,), {}, (out, None))
    out.backward(dy)


def test_hooks_measure_each_gemm_operand_along_its_axis():
    """x (T=6 tokens in 2x3, K=8), w (N=12, K=8), dy (T, N=12), tiles of 4: each operand's
    sums equal brute force on the operand quantized along its GEMM's reduction dim (fprop x
    and w along K, dgrad dy and w along N, wgrad dy and x along T), summed over two passes."""
    torch.manual_seed(0)
    collector = _collector()
    collector.reset(seed=5)
    passes = [(torch.randn(2, 3, 8), torch.randn(12, 8), torch.randn(2, 3, 12))
              for _ in range(2)]
    for x, w, dy in passes:
        _pass(collector, x.clone(), w, dy)
    got = collector.sums["L0.qkv"].numpy()
    expect = np.zeros((6, 4))
    for x, w, dy in passes:
        x2, dy2 = x.reshape(6, 8), dy.reshape(6, 12)
        for name, t, fmt, axis in (("fprop.x", x, FORMATS.x, -1), ("fprop.w", w, FORMATS.w, 1),
                                   ("dgrad.dy", dy, FORMATS.dy, -1),
                                   ("dgrad.w", w, FORMATS.w, 0),
                                   ("wgrad.dy", dy2, FORMATS.dy, 0),
                                   ("wgrad.x", x2, FORMATS.x, 0)):
            expect[OPERANDS.index(name)] += _brute(t, fake_quant(t, fmt, axis=axis))
    np.testing.assert_allclose(got, expect, rtol=1e-12)
    assert got[:, 0].sum() > 0  # FP4 flushes some elements to zero


def test_stochastic_rounding_leaves_training_rng_alone_and_is_reproducible():
    formats = SiteFormats("fp4_e2m1@tile4", "fp4_e2m1@block4", "fp4_e2m1@tile4+sr")
    x, w, dy = torch.randn(6, 8), torch.randn(12, 8), torch.randn(6, 12)
    runs = []
    for _ in range(2):
        collector = _collector(formats)
        collector.reset(seed=7)
        before = torch.get_rng_state()
        _pass(collector, x.clone(), w, dy)
        assert torch.equal(torch.get_rng_state(), before)
        runs.append(collector.sums["L0.qkv"].clone())
    assert torch.equal(*runs)


def test_no_statistics_outside_training_passes_and_reset_drops_them():
    collector = _collector()
    collector.reset(seed=0)
    x, w = torch.randn(6, 8), torch.randn(12, 8)
    with torch.no_grad():  # evaluation
        collector._forward("L0.qkv", SimpleNamespace(observer=None, weight=w), (x,), {},
                           (x @ w.t(), None))
    observed = SimpleNamespace(observer=lambda *a: None, weight=w)  # a SNIP / PGQ replay
    collector._forward("L0.qkv", observed, (x,), {}, (x @ w.t(), None))
    assert collector.sums == {}
    _pass(collector, x, w, torch.randn(6, 12))
    assert collector.sums
    collector.reset(seed=1)
    assert collector.sums == {}
