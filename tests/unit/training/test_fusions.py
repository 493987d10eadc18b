"""megatron-core's fusions that run on torch alone (``training/model.py``'s ``fusions``): which
are on per device, and that a model with them computes what the unfused one does.

The fused functions are compiled by ``torch.compile``; inductor's C++ compile of them takes
minutes on a CPU, so here they run under ``force_eager``: megatron's fused formulas (the
SwiGLU autograd function with its hand-written backward, the fused cross-entropy's forward
and gradient), uncompiled."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.training.arguments import parse_args
from megatron_ext.training.model import build_model_chunks, fusions, transformer_config

sys.path.insert(0, str(Path(__file__).parents[1] / "precision"))
from precision_helpers import megatron_world  # noqa: E402,F401  (fixture)

OFF = dict(bias_activation_fusion=False, cross_entropy_loss_fusion=False,
           bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
           gradient_accumulation_fusion=False, persist_layer_norm=False)


def _args(family: str = "llama", *flags: str):
    return parse_args(family, ["--mock-data", "--num-layers", "2", "--seq-length", "16",
                               "--global-batch-size", "2", "--micro-batch-size", "2", *flags],
                      world_size=1)


def _on(args, device: str) -> set:
    return {k for k, v in dataclasses.asdict(fusions(args, device)).items() if v is True}


def test_swiglu_and_cross_entropy_are_fused_on_cuda_only():
    assert _on(_args("llama", "--bf16"), "cuda") == {"bias_activation_fusion",
                                                    "cross_entropy_loss_fusion"}
    assert _on(_args("llama", "--bf16"), "cpu") == set()
    assert _on(_args("llama"), "cuda") == {"bias_activation_fusion"}  # FP32: BF16 logits grad
    assert _on(_args("gpt", "--bf16"), "cuda") == {"cross_entropy_loss_fusion"}  # GeLU
    assert _on(_args("llama", "--bf16", "--no-bias-swiglu-fusion",
                     "--no-cross-entropy-loss-fusion"), "cuda") == set()
    assert transformer_config(_args("llama", "--bf16")).bias_activation_fusion is False  # CPU


def _loss_and_grads(config, args):
    """The per-token loss and the gradients of a tiny model built with ``config``."""
    from megatron.core import tensor_parallel

    torch.manual_seed(3)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    model = build_model_chunks(args, config, 512)[0]
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens.roll(-1, 1))
    loss.float().mean().backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.usefixtures("megatron_world")
def test_the_cuda_fusions_compute_what_the_unfused_model_does(monkeypatch):
    from megatron.core.models.common.language_module import language_module
    from megatron.core.transformer import mlp

    used = []
    for module, name in ((mlp, "bias_swiglu_impl"),
                         (language_module, "fused_vocab_parallel_cross_entropy")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name: used.append(_n) or _r(*a))
    args = _args("llama", "--bf16")
    base = transformer_config(args)
    fused = dataclasses.replace(base, **dataclasses.asdict(fusions(args, "cuda")))
    torch.compiler.set_stance("force_eager")
    try:
        loss, grads = _loss_and_grads(fused, args)
    finally:
        torch.compiler.set_stance("default")
    assert sorted(set(used)) == ["bias_swiglu_impl", "fused_vocab_parallel_cross_entropy"]
    used.clear()
    ref_loss, ref_grads = _loss_and_grads(dataclasses.replace(base, **OFF), args)
    assert used == []
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, ref in ref_grads.items():
        # BF16 gradients: the fused backward rounds in another order (an ulp here and there)
        assert (grads[name] - ref).norm() <= 1e-2 * ref.norm(), name
