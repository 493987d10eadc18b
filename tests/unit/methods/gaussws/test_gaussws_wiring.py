"""The training wiring's own numerics: eq. 6's bound read from a site's plan formats, and eq. 10's
gradient added to the b_i gradient buffers before the optimizer step (float64 reference)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.methods.gaussws import GaussWSConfig, GaussWSWeight, ShardLayout
from megatron_ext.methods.gaussws.attach import SampledSites, max_bits
from megatron_ext.methods.gaussws.extension import GaussWSRun
from megatron_ext.methods.gaussws.weight import bitwidth_loss, bitwidth_loss_grads
from megatron_ext.precision.controller import PlanController
from megatron_ext.precision.site_formats import SiteFormats


@pytest.mark.parametrize("formats, dtype, bound", [
    (SiteFormats(), torch.float32, 25.0),           # no plan: ŵ enters the GEMM as float32
    (SiteFormats(), torch.bfloat16, 9.0),
    (SiteFormats(w="fp8_e4m3@block128"), torch.float32, 5.0),
    (SiteFormats(w="bf16", overrides=(("dgrad.w", "mxfp4"),)), torch.float32, 3.0),  # narrower
    (SiteFormats(w="int8@block128"), torch.float32, None),  # no floating-point bound
])
def test_eq6_bound_follows_the_weight_formats(formats, dtype, bound):
    assert max_bits(formats, dtype) == bound


def test_eq10_gradient_reaches_the_buffers():
    # eq. 9's target (2) differs from eq. 10's (4): the loss must pull towards 4
    config = GaussWSConfig(("proj", "fc2"), b_init=6.0, b_target_decay=2.0, b_target_loss=4.0,
                           lam=0.5)
    run = GaussWSRun(PlanController())
    run.config, run.sampled = config, SampledSites(config, seed=1)
    shapes = {"L0.proj": (64, 64), "L0.fc2": (64, 96)}
    for sid, shape in shapes.items():
        weight = GaussWSWeight(ShardLayout.full(*shape), config)
        weight.b_i.main_grad = torch.zeros_like(weight.b_i)
        with torch.no_grad():
            weight.b_i.copy_(torch.linspace(-1.0, 2.0, weight.b_i.numel()).view_as(weight.b_i))
        run.sampled.modules[sid] = SimpleNamespace(
            gaussws=weight, formats=SiteFormats(w="fp8_e4m3@block128"), weight=torch.zeros(1))
    run.tiles = 100  # the model-wide n: other stages hold more tiles
    run._add_bitwidth_loss_grad(SimpleNamespace(get_loss_scale=lambda: torch.tensor(2.0)))
    for sid in shapes:
        b_i = run.sampled.modules[sid].gaussws.b_i.detach().double()
        b_t = 2.0 + 4.0 * b_i
        # d/db_i of λ/n |min(b_t, 5) - 4| (∂b_t/∂b_i = 4), times the loss scale 2; 0 above
        # the eq. 6 clamp
        expected = 2.0 * 0.5 / 100 * torch.sign(b_t - 4.0) * 4.0 * (b_t < 5.0)
        got = run.sampled.modules[sid].gaussws.b_i.main_grad.double()
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_bit_width_statistics_only_on_logged_steps():
    config = GaussWSConfig(("proj",))
    run = GaussWSRun(PlanController())
    run.config, run.sampled, run.site_ids = config, SampledSites(config, seed=1), ["L0.proj"]
    quiet = SimpleNamespace(step_result={"logged": False})
    assert run.on_step(None, quiet, SimpleNamespace(iteration=4)) is None  # no collective
    assert run.sampled.step == 5  # the next step's key is set all the same


def test_checkpoint_state_restores_the_run_seed_and_checks_the_settings():
    config = GaussWSConfig(("proj", "fc2"))
    run = GaussWSRun(PlanController())
    run.config, run.sampled = config, SampledSites(config, seed=1)
    saved = run.state_dict()
    run.sampled = SampledSites(config, seed=2)  # resumed under another --seed
    run.load_state_dict(saved)
    assert run.sampled.seeds.key("L0.fc2", 3) == SampledSites(config, 1).seeds.key("L0.fc2", 3)
    with pytest.raises(UsageError, match="checkpoint's GaussWS"):
        run.load_state_dict({**saved, "sites": ["fc2"]})


def test_eq10_closed_form_is_autograds_bit_for_bit():
    config = GaussWSConfig(("proj", "fc2"), b_init=6.0, b_target_decay=2.0, b_target_loss=4.0)
    gen = torch.Generator().manual_seed(3)
    weights = [GaussWSWeight(ShardLayout.full(*shape), config) for shape in ((96, 64), (64, 200))]
    bounds = [5.0, None]
    with torch.no_grad():
        for w in weights:
            w.b_i.copy_(torch.rand(w.b_i.shape, generator=gen) * 1.5 - 0.2)
            w.b_i.view(-1)[:3] = torch.tensor([0.5, 0.75, 1.0])  # b_t = 4 (target), 5 (bound), 6
    loss = bitwidth_loss([w.bits(b) for w, b in zip(weights, bounds)], 4.0, 3e-4, count=777)
    expected = torch.autograd.grad(loss, [w.b_i for w in weights])
    got = bitwidth_loss_grads(weights, bounds, 4.0, 3e-4, 777)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert got[0].view(-1)[0] == 0 and got[0].view(-1)[1] != 0 and got[0].view(-1)[2] == 0
    assert got[1].view(-1)[2] != 0  # no bound: 6 bits pulled down


def test_bit_width_statistics_of_all_sites_at_once():
    config = GaussWSConfig(("proj", "fc2"), b_init=6.0, b_target_decay=2.0)
    sites = SampledSites(config, seed=1)
    formats = {"L0.proj": SiteFormats(w="fp8_e4m3@block128"), "L1.fc2": SiteFormats()}
    for sid, shape in {"L0.proj": (64, 64), "L1.fc2": (70, 100)}.items():
        weight = GaussWSWeight(ShardLayout.full(*shape), config)
        with torch.no_grad():
            weight.b_i.uniform_(0.0, 1.2, generator=torch.Generator().manual_seed(5))
            weight.b_i.view(-1)[0] = 1.2  # b_t = 6.8: above the FP8 bound
        sites.modules[sid] = SimpleNamespace(gaussws=weight, formats=formats[sid],
                                             weight=torch.zeros(1))
    got = sites.stats(["L1.fc2", "L0.proj"])
    for row, sid in enumerate(["L1.fc2", "L0.proj"]):
        expected = sites.modules[sid].gaussws.stats(sites.bound(sid))
        assert got[row, 1] == expected["min"] and got[row, 2] == expected["max"]
        mean = sites.bits(sid).detach().double().mean().item()  # what the metrics had
        assert got[row, 0].item() == pytest.approx(mean, rel=1e-14)
    assert got[1, 2] == 5.0  # L0.proj clamped at eq. 6's FP8 bound
