"""``SDPAttention`` (``--attention-backend sdpa``) against megatron-core's local
``DotProductAttention`` and a float64 reference: forward and backward, GQA, layer scaling, masks,
bias, dropout, TP=2 with heads split (gloo), and what it keeps for backward."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain_runner import free_port

S, B, HEAD_DIM = 16, 2, 8
FWD_TOL = dict(rtol=1e-10, atol=1e-12)  # float64: both paths are exact up to summation order


def _world(rank: int, world: int, port: int) -> None:
    from megatron.core import parallel_state, tensor_parallel

    from megatron_ext.compat import cpu
    from megatron_ext.training.distributed import LaunchInfo, init_process_group

    cpu.activate()
    init_process_group(LaunchInfo("single" if world == 1 else "torchrun", rank, world, rank,
                                  "127.0.0.1", port), backend="gloo")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(world, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _teardown() -> None:
    from megatron.core import parallel_state

    from megatron_ext.compat import cpu

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    cpu.deactivate()


@pytest.fixture(scope="module")
def world():
    _world(0, 1, free_port())
    yield
    _teardown()


def _config(heads: int, groups: int, **kw):
    from megatron.core.transformer import TransformerConfig

    kw = {"attention_dropout": 0.0, **kw}  # megatron-core's default is 0.1
    return TransformerConfig(num_layers=4, hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
                             num_query_groups=groups, params_dtype=torch.float64,
                             use_cpu_initialization=True, **kw)


def _pair(config, layer: int = 1, softmax_scale=None):
    """(local DotProductAttention, SDPAttention), built as SelfAttention builds them."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.training.sdpa import SDPAttention

    kw = dict(config=config, layer_number=layer, attn_mask_type=AttnMaskType.causal,
              attention_type="self", softmax_scale=softmax_scale)
    return DotProductAttention(**kw), SDPAttention(**kw)


def _qkv(heads: int, groups: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((S, B, heads, HEAD_DIM), (S, B, groups, HEAD_DIM), (S, B, groups, HEAD_DIM))
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _run(module, qkv, mask=None, **kw):
    """Output and the gradients of q, k, v for a fixed random output gradient."""
    leaves = [t.clone().requires_grad_() for t in qkv]
    out = module(*leaves, mask, **kw)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    out.backward(dy)
    return [out.detach()] + [t.grad for t in leaves]


def _reference(qkv, scale: float, masked: torch.Tensor, bias=None):
    """Plain float64 attention: ``[s, b, h, d]`` in, ``[s, b, h*d]`` out (GQA by repetition)."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in qkv)
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    logits = q @ k.transpose(-1, -2) * scale + (0 if bias is None else bias)
    probs = logits.masked_fill(masked, float("-inf")).softmax(-1)
    return (probs @ v).permute(2, 0, 1, 3).reshape(S, B, -1)


CASES = {  # heads, groups, config extras, layer number, softmax_scale
    "mha": (4, 4, {}, 1, None),
    "gqa": (4, 2, {}, 1, None),
    "mqa": (4, 1, {}, 1, None),
    "qk-layer-scaling": (4, 2, {"apply_query_key_layer_scaling": True}, 3, None),
    "softmax-scale": (4, 4, {}, 1, 0.3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_match_local_attention(world, name):
    heads, groups, extra, layer, scale = CASES[name]
    local, sdpa = _pair(_config(heads, groups, **extra), layer, scale)
    qkv = _qkv(heads, groups)
    for got, want in zip(_run(sdpa, qkv), _run(local, qkv), strict=True):
        torch.testing.assert_close(got, want, **FWD_TOL)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    torch.testing.assert_close(_run(sdpa, qkv)[0], _reference(
        qkv, scale or 1 / math.sqrt(HEAD_DIM), causal), **FWD_TOL)


def test_given_mask_wins_like_local(world):
    """A megatron boolean mask (True = masked out) replaces the causal one, as in the local
    path: here a padding mask hiding each sequence's last 5 keys."""
    local, sdpa = _pair(_config(4, 2))
    mask = torch.zeros(B, 1, S, S, dtype=torch.bool)
    mask[..., -5:] = True
    qkv = _qkv(4, 2, seed=1)
    for got, want in zip(_run(sdpa, qkv, mask), _run(local, qkv, mask), strict=True):
        torch.testing.assert_close(got, want, **FWD_TOL)


def test_attention_bias_is_added_to_the_causal_logits(world):
    """megatron's local path refuses a bias; SDPA adds it (reference: float64 attention)."""
    _, sdpa = _pair(_config(4, 2))
    bias = torch.randn(1, 4, S, S, dtype=torch.float64)
    qkv = _qkv(4, 2, seed=2)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    got = _run(sdpa, qkv, attention_bias=bias)[0]
    torch.testing.assert_close(got, _reference(qkv, 1 / math.sqrt(HEAD_DIM), causal, bias),
                               **FWD_TOL)


def test_dropout_is_unbiased_and_follows_the_model_parallel_rng(world):
    """Dropout on the probabilities: drawn from the tracker's model-parallel generator (same
    tracker state -> same output), different from the eval output, equal to it on average."""
    from megatron.core import tensor_parallel

    _, sdpa = _pair(_config(4, 2, attention_dropout=0.3))
    qkv = _qkv(4, 2, seed=3)
    sdpa.eval()
    clean = sdpa(*qkv, None)
    sdpa.train()
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    first = sdpa(*qkv, None)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    assert torch.equal(sdpa(*qkv, None), first)
    assert not torch.allclose(first, clean)
    mean = torch.stack([sdpa(*qkv, None) for _ in range(100)]).mean(0)
    assert (mean - clean).abs().mean() < 0.15 * clean.abs().mean()  # one draw: ~0.66


def _saved_elements(module, qkv) -> int:
    """Largest tensor (in elements) autograd keeps for ``module``'s backward."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    leaves = [t.clone().requires_grad_() for t in qkv]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*leaves, None)
    return max(sizes)


def test_keeps_no_s_by_s_probabilities_for_backward(world):
    """The local path keeps the b x h x s x s probabilities; SDPA keeps q, k, v, the output
    and the per-row log-sum-exp (the largest is b x h x s x d, d = 8 < s = 16)."""
    local, sdpa = _pair(_config(4, 2))
    qkv = _qkv(4, 2)
    assert _saved_elements(local, qkv) == B * 4 * S * S
    assert _saved_elements(sdpa, qkv) == B * 4 * S * HEAD_DIM


def _tp2_worker(rank: int, port: int) -> None:
    """At TP=2 each rank holds half the heads and half the groups: SDPA on them equals the
    local path on them and the matching half of the full-head float64 reference."""
    _world(rank, 2, port)
    try:
        heads, groups = 4, 2
        local, sdpa = _pair(_config(heads, groups, tensor_model_parallel_size=2))
        full = _qkv(heads, groups, seed=4)
        mine = [t.chunk(2, dim=2)[rank] for t in full]
        got = _run(sdpa, mine)
        for g, w in zip(got, _run(local, mine), strict=True):
            torch.testing.assert_close(g, w, **FWD_TOL)
        causal = torch.ones(S, S, dtype=torch.bool).triu(1)
        want = _reference(full, 1 / math.sqrt(HEAD_DIM), causal).view(S, B, heads, -1)
        torch.testing.assert_close(got[0].view(S, B, heads // 2, -1),
                                   want.chunk(2, dim=2)[rank], **FWD_TOL)
    finally:
        _teardown()


def test_tensor_parallel_heads_split_gloo():
    mp.spawn(_tp2_worker, args=(free_port(),), nprocs=2, join=True)


def test_attention_backend_resolution():
    """auto: sdpa in local layers, TE's own choice in TE layers; each backend only where its
    layers run it (one-line UsageError otherwise); an explicit local backend keeps
    ``--transformer-impl auto`` on local layers even where TE could run."""
    from megatron_ext.errors import UsageError
    from megatron_ext.training.attention_backend import resolve_attention_backend as resolve
    from megatron_ext.training.layer_impl import resolve_transformer_impl

    assert [resolve(b, "local") for b in ("auto", "sdpa", "local")] == ["sdpa", "sdpa", "local"]
    assert ([resolve(b, "transformer_engine") for b in ("auto", "flash", "fused", "unfused")]
            == ["auto", "flash", "fused", "unfused"])
    with pytest.raises(UsageError, match="flash is Transformer Engine's"):
        resolve("flash", "local")
    with pytest.raises(UsageError, match="sdpa runs in megatron-core's local layers"):
        resolve("sdpa", "transformer_engine")
    assert resolve_transformer_impl("auto", False, True, "sdpa") == "local"


@pytest.mark.parametrize("backend, module", [("auto", "SDPAttention"), ("sdpa", "SDPAttention"),
                                             ("local", "DotProductAttention")])
def test_the_flag_picks_the_core_attention_of_every_layer(world, backend, module):
    from megatron_ext.training.arguments import parse_args
    from megatron_ext.training.model import build_model_chunks, transformer_config

    args = parse_args("llama", ["--mock-data", "--attention-backend", backend], world_size=1)
    layers = build_model_chunks(args, transformer_config(args), 512)[0].decoder.layers
    assert {type(layer.self_attention.core_attention).__name__ for layer in layers} == {module}


def test_twenty_training_steps_match_the_local_backend(run_pretrain):
    """The tiny Llama (GQA 4 heads / 2 groups, FP32) trains the same 20 steps with either core
    attention (measured: largest relative loss difference 7e-7); args.json records which."""
    from pretrain_runner import train_losses

    steps = ["--train-iters", "20", "--no-save"]
    runs = {b: run_pretrain(b, [*steps, "--attention-backend", "auto" if b == "sdpa" else b])
            for b in ("sdpa", "local")}
    for backend, run_dir in runs.items():
        assert json.loads((run_dir / "args.json").read_text())["attention_backend"] == backend
    sdpa, local = (train_losses(runs[b]) for b in ("sdpa", "local"))
    assert sorted(sdpa) == sorted(local) == list(range(1, 21))
    for step, loss in local.items():
        assert sdpa[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
