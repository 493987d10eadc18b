"""What one sampled linear keeps for its backward: a real quantized megatron linear with the
GaussWS transform attached saves no ŵ-sized tensor beyond what the same linear saves without
GaussWS (the GEMM keeps w and rebuilds ŵ), and computes what ŵ kept by autograd computes."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer import TransformerConfig

from megatron_ext.methods.gaussws import GaussWSConfig, noise
from megatron_ext.methods.gaussws.attach import SampledSites
from megatron_ext.precision.layers import quantized_class
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats

sys.path.insert(0, str(Path(__file__).parents[2] / "precision"))
from precision_helpers import megatron_world  # noqa: E402,F401  (fixture)

pytestmark = pytest.mark.usefixtures("megatron_world")

N, K, S, B = 96, 200, 8, 3  # fc2: 96 x 200, ragged tiles
FORMATS = {
    "no plan": SiteFormats(),
    "fp8, dgrad reuses q(w)": UNIFORM["fp8"],
    "fp8, dgrad quantizes afresh": SiteFormats("fp8_e4m3@tile128", "fp8_e4m3@tile128",
                                               "fp8_e4m3@tile128"),
}


def _layer(formats, sampled: bool):
    config = TransformerConfig(num_layers=1, hidden_size=N, ffn_hidden_size=K,
                               num_attention_heads=4, add_bias_linear=True,
                               use_cpu_initialization=True, gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    layer = quantized_class(RowParallelLinear, 0, "fc2")(
        K, N, config=config, init_method=torch.nn.init.normal_, bias=True,
        input_is_parallel=True, skip_bias_add=False)
    layer.formats = formats
    sites = SampledSites(GaussWSConfig(("fc2",), b_init=5.0), seed=7)
    if sampled:
        sites.attach([layer])
    return layer, sites


def _forward(layer, x):
    """(output, bytes and numels of the saved tensors that x and the parameters do not own)."""
    owned = {t.untyped_storage().data_ptr() for t in (x, *layer.parameters())}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, _ = layer(x)
    new = {t.untyped_storage().data_ptr(): t for t in saved
           if t.untyped_storage().data_ptr() not in owned}
    return out, sum(t.untyped_storage().nbytes() for t in new.values()), [
        t.numel() for t in new.values()]


@pytest.mark.parametrize("name", FORMATS)
def test_a_sampled_linear_saves_no_w_hat(name):
    x = torch.randn(S, B, K, requires_grad=True)
    _, plain_bytes, plain_numels = _forward(_layer(FORMATS[name], False)[0], x)
    layer, _ = _layer(FORMATS[name], True)
    _, sampled_bytes, sampled_numels = _forward(layer, x)
    tiles = layer.gaussws.b_i.numel()
    assert sampled_numels.count(N * K) <= plain_numels.count(N * K)  # no ŵ-sized tensor added
    added = Counter(sampled_numels) - Counter(plain_numels)
    assert set(added) == {tiles}  # tile grids only: s, and the eq. 6 clamp's input
    assert (sampled_bytes - plain_bytes) / (N * K) <= 0.5


@pytest.mark.parametrize("name", FORMATS)
def test_rebuilt_w_hat_computes_what_a_kept_w_hat_computes(name, monkeypatch):
    """The same layer with the transform's ŵ handed on as a plain tensor (autograd keeps it):
    output and every gradient (x, w, bias, b_i) bit for bit. R is generated once in each
    pass: the backward's rebuild of ŵ hands its R on to eq. 3."""
    x, dy = torch.randn(S, B, K), torch.randn(S, B, N)
    calls, real = [], noise.noise_block
    monkeypatch.setattr(noise, "noise_block", lambda *a: calls.append(a) or real(*a))
    results = []
    for recompute in (True, False):
        calls.clear()
        layer, sites = _layer(FORMATS[name], True)
        if not recompute:
            layer.transforms = (lambda m, x_, w: (x_, sites.transform(m, x_, w)[1].value),)
        xs = x.clone().requires_grad_()
        torch.manual_seed(1)  # stochastic formats (none here) would draw alike
        out, _ = layer(xs)
        out.backward(dy)
        results.append([out.detach(), xs.grad, *(p.grad for p in layer.parameters())])
        assert len(calls) == 2  # forward; backward (rebuild + eq. 3, or eq. 3 alone)
    assert len(results[0]) == 5 and all(t is not None for t in results[0])  # y; x, w, bias, b_i
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
