"""The PGQ observers on real megatron layers against a float64 brute force that quantizes with
``fake_quant``'s ``axis`` argument (not the profile's transposes), and the layer's gradients
unchanged by observing."""

import sys
from pathlib import Path

import pytest
import torch
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                           VocabParallelEmbedding)
from megatron.core.transformer import TransformerConfig

from megatron_ext.formats import fake_quant
from megatron_ext.methods.pgq.observe import GemmObserver
from megatron_ext.precision.layers import quantized_class
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats

sys.path.insert(0, str(Path(__file__).parents[2] / "precision"))
from precision_helpers import megatron_world  # noqa: E402,F401  (fixture)

pytestmark = pytest.mark.usefixtures("megatron_world")

H, F, S, B, V = 128, 256, 48, 2, 320
CANDIDATES = {"fp8": UNIFORM["fp8"], "int8": SiteFormats("int8@row", "int8@row", "int8@row"),
              "mx": SiteFormats("mxfp8", "mxfp4", "mxfp8_e5m2")}  # deterministic rounding
# the tensor dimension each operand's blocks run along (x, dy flattened to T x ·, w N x K)
AXIS = {("fprop", "x"): 1, ("fprop", "w"): 1, ("dgrad", "dy"): 1, ("dgrad", "w"): 0,
        ("wgrad", "dy"): 0, ("wgrad", "x"): 0}


def _config():
    return TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=F,
                             num_attention_heads=4, add_bias_linear=False,
                             use_cpu_initialization=True, gradient_accumulation_fusion=False)


def _layer(base):
    size_in, size_out = (H, F) if base is ColumnParallelLinear else (F, H)
    kw = {"gather_output": False} if base is ColumnParallelLinear else {"input_is_parallel": True}
    return quantized_class(base, 0, "fc1")(size_in, size_out, config=_config(),
                                           init_method=torch.nn.init.normal_, bias=False,
                                           skip_bias_add=True, **kw)


def _expected(t: torch.Tensor, gemm: str, role: str, formats: dict, axis=None) -> list[float]:
    axis = AXIS[(gemm, role)] if axis is None else axis
    t = t.detach().float()
    sums = [float(t.double().square().sum())]
    for f in formats.values():
        fmt = f.operand(gemm, role)
        error = fake_quant(t, fmt, axis=axis).double() - t.double()
        sums.append(float(error.square().sum()))
    return sums


@pytest.mark.parametrize("base", [ColumnParallelLinear, RowParallelLinear])
def test_linear_observer_equals_brute_force(base):
    torch.manual_seed(0)
    layer = _layer(base)
    k, n = layer.weight.shape[1], layer.weight.shape[0]
    x, dy = torch.randn(S, B, k), torch.randn(S, B, n)
    x[4, 1] *= 25  # an outlier token
    grads = []
    for observer in (None, GemmObserver(CANDIDATES)):
        layer.observer, layer.weight.grad = observer, None
        xg = x.clone().requires_grad_()
        y, _ = layer(xg)
        y.backward(dy)
        grads.append((y.detach(), xg.grad, layer.weight.grad.clone()))
    layer.observer = None
    for exact, observed in zip(*grads):  # observing runs the layer's own unquantized GEMM
        torch.testing.assert_close(observed, exact)
    tensors = {"x": x.reshape(-1, k), "w": layer.weight, "dy": dy.reshape(-1, n)}
    for (gemm, role), got in observer.sums.items():
        assert got.tolist() == pytest.approx(_expected(tensors[role], gemm, role, CANDIDATES),
                                    rel=1e-9), (gemm, role)
    assert set(observer.sums) == set(AXIS)


def test_weights_are_measured_once_activations_every_call():
    torch.manual_seed(1)
    layer, observer = _layer(ColumnParallelLinear), GemmObserver(CANDIDATES)
    layer.observer = observer
    x = torch.randn(S, B, H)
    for _ in range(3):
        layer(x.clone().requires_grad_())[0].sum().backward()
    layer.observer = None
    once = _expected(layer.weight, "fprop", "w", CANDIDATES)
    thrice = [3 * v for v in _expected(x.reshape(-1, H), "fprop", "x", CANDIDATES)]
    assert observer.sums[("fprop", "w")].tolist() == pytest.approx(once, rel=1e-9)
    assert observer.sums[("fprop", "x")].tolist() == pytest.approx(thrice, rel=1e-9)


def test_embedding_hook_measures_the_table_along_v_and_dy_along_t():
    torch.manual_seed(2)
    emb = VocabParallelEmbedding(V, H, init_method=torch.nn.init.normal_, config=_config())
    observer = GemmObserver(CANDIDATES)
    handle = emb.register_forward_hook(observer.embedding_hook)
    tokens = torch.randint(0, V, (B, S))
    dy = torch.randn(B, S, H)
    emb(tokens).backward(dy)
    handle.remove()
    assert set(observer.sums) == {("fprop", "w"), ("wgrad", "dy")}
    table = _expected(emb.weight, "fprop", "w", CANDIDATES, axis=0)  # V x H, along V
    grad = _expected(dy.reshape(-1, H), "wgrad", "dy", CANDIDATES, axis=0)  # along T
    assert observer.sums[("fprop", "w")].tolist() == pytest.approx(table, rel=1e-9)
    assert observer.sums[("wgrad", "dy")].tolist() == pytest.approx(grad, rel=1e-9)
