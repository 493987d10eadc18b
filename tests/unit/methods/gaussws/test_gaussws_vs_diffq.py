"""benchmarks/gaussws_vs_diffq.py's DiffQ wiring: the site -> parameter mapping (DiffQ's
``exclude`` list leaves exactly the chosen sites' weights quantized, on a toy model with
megatron's module paths, expected names written out by hand) and the size-loss gradient
(closed form)."""

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).parents[4]
_SPEC = importlib.util.spec_from_file_location("_gaussws_vs_diffq",
                                               REPO / "benchmarks" / "gaussws_vs_diffq.py")
BENCH = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(BENCH)


def _module(**children):
    m = nn.Module()
    for name, child in children.items():
        setattr(m, name, child)
    return m


class ToyLlama(nn.Module):
    """Megatron's GPTModel paths: embedding, decoder.layers.i.{self_attention,mlp}.*, norms
    and the output layer; proj has a bias (which DiffQ must leave alone). The forward calls
    every linear once on its own input and records which ones saw their own parameter."""

    def __init__(self, layers=2):
        super().__init__()
        self.embedding = _module(word_embeddings=nn.Embedding(16, 8))
        self.decoder = _module(layers=nn.ModuleList(self._layer() for _ in range(layers)),
                               final_layernorm=nn.LayerNorm(8))
        self.output_layer = nn.Linear(8, 16, bias=False)
        self.noised = set()

    @staticmethod
    def _layer():
        return _module(input_layernorm=nn.LayerNorm(8),
                       self_attention=_module(linear_qkv=nn.Linear(8, 24, bias=False),
                                              linear_proj=nn.Linear(8, 8)),
                       mlp=_module(linear_fc1=nn.Linear(8, 32, bias=False),
                                   linear_fc2=nn.Linear(16, 8, bias=False)))

    def forward(self, rows):
        out = 0
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if not isinstance(m.weight, nn.Parameter):
                    self.noised.add(f"{name}.weight")
                out = out + m(torch.randn(rows, m.in_features)).sum()
        return out


OD = {f"decoder.layers.{i}.{path}.weight" for i in (0, 1)
      for path in ("self_attention.linear_proj", "mlp.linear_fc2")}
ALL = OD | {f"decoder.layers.{i}.{path}.weight" for i in (0, 1)
            for path in ("self_attention.linear_qkv", "mlp.linear_fc1")}


@pytest.mark.parametrize("sites, kept", [(("proj", "fc2"), OD),
                                         (("qkv", "proj", "fc1", "fc2"), ALL)])
def test_exclude_leaves_exactly_the_sites_weights(sites, kept):
    model = ToyLlama()
    everything = {name for name, _ in model.named_parameters()}
    assert kept < everything
    assert set(BENCH.diffq_exclude(model, sites)) == everything - kept


@pytest.mark.skipif(not BENCH.diffq_available(), reason="diffq is not installed")
def test_diffq_noises_only_the_sites_weights():
    from diffq import DiffQuantizer

    torch.manual_seed(0)
    model = ToyLlama()
    q = DiffQuantizer(model, min_size=0, group_size=16,
                      exclude=BENCH.diffq_exclude(model, ("proj", "fc2")))
    q.no_optimizer()
    logits = {n for n, _ in model.named_parameters() if n.endswith("_diffq")}
    assert logits == {f"{n}_diffq" for n in OD}
    weights = dict(model.named_parameters())
    model.train()
    model(3).backward()
    assert model.noised == OD
    assert all(p is weights[n] for n, p in model.named_parameters())  # DiffQ put them back
    for name in OD:
        assert weights[name].grad is not None and weights[f"{name}_diffq"].grad is not None


@pytest.mark.skipif(not BENCH.diffq_available(), reason="diffq is not installed")
def test_size_loss_gradient_reaches_the_logits_before_the_step():
    """The wrapped step adds ∂(penalty · model_size)/∂logit, times the loss scale, to each
    logit's gradient: in closed form, group_size · (max_bits - min_bits) · t(1 - t) / 2^23
    (MB per bit) per group, t = sigmoid(logit) = (8 - 2) / (15 - 2) at DiffQ's initial 8 bits."""
    args = argparse.Namespace(diffq="od", diffq_group_size=16, diffq_noise="uniform",
                              diffq_penalty=1e-3, tensor_model_parallel_size=1)
    ext = BENCH.diffq_extension(None)
    ext.validate(args)
    model = ToyLlama()
    ext.after_model(args, [model])
    logits = [p for n, p in model.named_parameters() if n.endswith("_diffq")]
    for p in logits:
        p.grad = torch.zeros_like(p)
    stepped = []

    class Optimizer:
        def step(self):
            stepped.append([p.grad.clone() for p in logits])

        def get_loss_scale(self):
            return torch.tensor(4.0)

    ext.wrap_optimizer(args, [model], Optimizer()).step()
    t = 6 / 13
    expected = 4.0 * 1e-3 * 16 * (15 - 2) * t * (1 - t) / 2 ** 23
    assert len(stepped) == 1 and len(logits) == len(OD)
    for grad in stepped[0]:
        torch.testing.assert_close(grad, torch.full_like(grad, expected), rtol=1e-5, atol=0)
