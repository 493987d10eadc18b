"""Eq. 9 / 10 / 6 on the bit-width parameter, the settings and flags, and eq. 3 once per
step (the linear that rebuilds ŵ instead of keeping it: ``test_gaussws_memory.py``)."""

import argparse

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.methods.gaussws import (
    GaussSample,
    GaussWSConfig,
    GaussWSWeight,
    ShardLayout,
    add_arguments,
    bitwidth_loss,
    local_block_amax,
    parse_sites,
)

KEY = 424242


def _weight(shape=(100, 70), **kw):
    return GaussWSWeight(ShardLayout.full(*shape), GaussWSConfig(("fc2",), **kw))


def test_eq9_starts_at_b_init_and_chains_the_gradient():
    mod = _weight(b_init=6.0, b_target_decay=4.0)
    assert mod.b_i.shape == (4, 3) and torch.equal(mod.bits(), torch.full((4, 3), 6.0))
    w = torch.randn(100, 70)
    g = torch.randn(100, 70)
    (mod(w, KEY) * g).sum().backward()
    bits = mod.bits().detach().requires_grad_()
    amax = local_block_amax(w, mod.layout)
    (GaussSample.apply(w, bits, amax, KEY, mod.layout, None) * g).sum().backward()
    assert torch.equal(mod.b_i.grad, bits.grad * 2.0)  # ∂b_t/∂b_i = b_init - b_target


def test_default_decay_target_is_zero_bits():
    """The OPT2 setting: eq. 9 with b_target 0, so b_t = 6 · b_i and decay pulls b_t to 0."""
    mod = _weight()
    with torch.no_grad():
        mod.b_i.fill_(0.5)
    assert torch.equal(mod.bits(), torch.full((4, 3), 3.0))


def test_decaying_b_i_moves_b_t_to_b_target():
    """Decoupled weight decay multiplies b_i by (1 - lr·wd) per step (a torch optimizer's
    first step costs seconds of imports here, so the update is applied by hand)."""
    mod = _weight(b_init=6.0, b_target_decay=4.0)
    with torch.no_grad():
        mod.b_i.mul_((1 - 0.1 * 0.5) ** 3)
    assert (mod.bits() - (4.0 + 0.95**3 * 2.0)).abs().max() < 1e-6
    with torch.no_grad():
        mod.b_i.zero_()
    assert torch.equal(mod.bits(), torch.full((4, 3), 4.0))


def test_eq6_clamp_stops_the_gradient_above_the_bound():
    mod = _weight(b_init=6.0, b_target_decay=4.0)
    with torch.no_grad():
        mod.b_i[0, 0] = 0.0  # b_t = 4, under the bound
    assert torch.equal(mod.bits(max_bits=5).unique(), torch.tensor([4.0, 5.0]))
    mod(torch.randn(100, 70), KEY, max_bits=5).sum().backward()
    assert mod.b_i.grad[0, 0] != 0 and (mod.b_i.grad.view(-1)[1:] == 0).all()
    assert mod.stats() == {"mean": pytest.approx((4 + 11 * 6) / 12), "min": 4.0, "max": 6.0}


def test_eq10_loss_value_and_gradient():
    a = torch.tensor([[5.0, 3.0]], requires_grad=True)
    b = torch.tensor([[4.0, 6.5, 4.5]], requires_grad=True)
    loss = bitwidth_loss([a, b], b_target=4.0, lam=1e-4)
    assert loss.item() == pytest.approx(1e-4 / 5 * (1 + 1 + 0 + 2.5 + 0.5))
    loss.backward()
    assert torch.equal(a.grad, torch.tensor([[1.0, -1.0]]) * 1e-4 / 5)
    assert bitwidth_loss([a], 4.0, 1e-4, count=10).item() == pytest.approx(1e-4 / 10 * 2)


def test_sites_and_flags():
    assert parse_sites("od") == ("proj", "fc2")
    assert parse_sites("all") == ("qkv", "proj", "fc1", "fc2")
    assert parse_sites("fc2, qkv") == ("qkv", "fc2")
    for bad in ("", "fc3", "od,fc1", "qkv,,fc1"):
        with pytest.raises(UsageError, match="--gaussws"):
            parse_sites(bad)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = GaussWSConfig.from_args(parser.parse_args(["--gaussws", "od"]))
    # the paper's OPT2 setting (§4.1): b_target 0 for weight decay, 4 for the loss, λ 1e-4
    assert cfg == GaussWSConfig(("proj", "fc2"), 6.0, 0.0, 4.0, 1e-4, 32) and cfg.enabled
    flags = ["--gaussws", "od", "--gaussws-b-target-decay", "4", "--gaussws-b-target-loss",
             "3", "--gaussws-lambda", "0"]
    assert GaussWSConfig.from_args(parser.parse_args(flags)) == GaussWSConfig(
        ("proj", "fc2"), 6.0, 4.0, 3.0, 0.0, 32)
    assert not GaussWSConfig.from_args(parser.parse_args([])).enabled
    for kw in ({"b_init": 0.0}, {"block": 0}, {"lam": -1.0}):
        with pytest.raises(UsageError):
            GaussWSConfig(("fc2",), **kw)


def test_bits_grad_once_per_step_equals_the_micro_batch_sum():
    """Three micro-batches under one key: eq. 3 from the accumulated weight gradient, once,
    equals the b_i gradient the per-micro-batch backward passes add up."""
    per_mb, deferred = _weight(), _weight()
    for mod in (per_mb, deferred):
        with torch.no_grad():
            mod.b_i.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(100, 70, generator=gen, requires_grad=True)
    grads = [torch.randn(100, 70, generator=gen) for _ in range(3)]
    for g in grads:
        per_mb(w, KEY, max_bits=6.0).backward(g)
    w_grad = w.grad.clone()
    w.grad = None
    for g in grads:
        deferred(w, KEY, max_bits=6.0, defer_bits_grad=True).backward(g)
    assert deferred.b_i.grad is None and torch.equal(w.grad, w_grad)
    deferred.accumulate_bits_grad(w.detach(), w.grad, KEY, max_bits=6.0)
    err = (deferred.b_i.grad - per_mb.b_i.grad).abs().max()
    assert err <= 1e-5 * per_mb.b_i.grad.abs().max() and (per_mb.b_i.grad == 0).any()


def test_tile_maxima_are_measured_once_per_step_key(monkeypatch):
    """A step's micro-batches sample the same weights with the same key: the tile maxima
    come from its first forward; a new key, or another tensor, measures again. Each ŵ equals
    the one a fresh module (no earlier call) makes."""
    from megatron_ext.methods.gaussws import weight as weight_module

    w = torch.randn(100, 70, generator=torch.Generator().manual_seed(3))
    w2 = w * 2
    fresh = [_weight()(w, KEY), _weight()(w2, KEY + 1)]
    calls = []
    real = weight_module.local_block_amax
    monkeypatch.setattr(weight_module, "local_block_amax",
                        lambda w, layout: (calls.append(1), real(w, layout))[1])
    mod = _weight()
    assert all(torch.equal(mod(w, KEY), fresh[0]) for _ in range(3)) and len(calls) == 1
    mod(w, KEY + 1)
    assert torch.equal(mod(w2, KEY + 1), fresh[1]) and len(calls) == 3
