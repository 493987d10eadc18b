"""torch's fused / foreach AdamW and the foreach gradient norm inside megatron's optimizer
(``megatron_ext/training/fused_optimizer.py``): which kernel megatron's wrapper holds, the
same numerics as megatron's own fallbacks, and a bit-exact resume."""

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_ext.training.fused_optimizer import (
    AdamKernel,
    adam_kernel,
    foreach_l2_norm,
    foreach_scale,
    torch_adams,
    use_adam_kernel,
)
from pretrain_runner import FAST_ARGS, launch, train_losses

sys.path.insert(0, str(Path(__file__).parents[1] / "precision"))
from precision_helpers import megatron_world  # noqa: E402,F401  (fixture)

FUSED, FOREACH = AdamKernel(fused=True, foreach=False), AdamKernel(fused=False, foreach=True)


def test_fused_on_cuda_and_foreach_elsewhere():
    assert adam_kernel("cuda") == FUSED
    assert adam_kernel("cpu") == FOREACH


class _Calls(TorchFunctionMode):
    """Counts the torch calls made under it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _calls(fn, *args) -> int:
    with _Calls() as mode:
        fn(*args)
    return mode.count


@pytest.mark.usefixtures("megatron_world")  # megatron's fallback allocates on "cuda"
def test_the_foreach_norm_and_scale_match_float64_and_make_no_call_per_tensor():
    from megatron.core.utils import local_multi_tensor_l2_norm

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * 10.0 ** (n % 5 - 2) for n in range(1, 40)]
    norm, _ = foreach_l2_norm(0, None, [grads], False)
    exact = torch.cat([g.double() for g in grads]).norm()
    assert norm.shape == (1,) and norm.dtype == torch.float32
    assert norm.item() == pytest.approx(exact.item(), rel=1e-6)
    assert norm.item() == local_multi_tensor_l2_norm(0, None, [grads], False)[0].item()
    few, many = (_calls(foreach_l2_norm, 0, None, [grads[:n]], False) for n in (3, 39))
    assert few == many  # megatron's local fallback: a norm and a host read per tensor
    scaled = [g.clone() for g in grads]
    foreach_scale(0, None, [scaled, scaled], 0.37)
    assert all(torch.equal(s, g * 0.37) for s, g in zip(scaled, grads))
    copies = [torch.empty_like(g) for g in grads]
    foreach_scale(0, None, [grads, copies], 1.0)
    assert all(torch.equal(c, g) for c, g in zip(copies, grads))


def _args():
    from megatron_ext.training.arguments import parse_args

    return parse_args("llama", ["--mock-data", "--bf16", "--num-layers", "2", "--clip-grad",
                                "0.05", "--lr", "1e-2", "--global-batch-size", "2",
                                "--micro-batch-size", "2", "--seq-length", "16"], world_size=1)


def _trained(kernel, megatron_fallbacks: bool, monkeypatch, steps: int = 3):
    """A tiny BF16 Llama (megatron DDP + Float16 optimizer) after ``steps`` clipped updates
    with ``kernel`` (None: torch's defaults, as megatron-core builds it) and megatron's own
    gradient-norm fallbacks or the foreach ones; returns (params, grad norms, optimizer)."""
    from megatron.core import tensor_parallel, utils
    from megatron.core.optimizer import clip_grads

    from megatron_ext.training.model import build_model_chunks, transformer_config
    from megatron_ext.training.optimizer import build_optimizer, wrap_ddp

    args = _args()
    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    config = transformer_config(args)
    model = wrap_ddp(args, config, build_model_chunks(args, config, 512))
    optimizer = build_optimizer(args, model)
    if megatron_fallbacks:
        monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
        monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    use_adam_kernel(optimizer, kernel or AdamKernel(fused=None, foreach=None))
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    norms = []
    for _ in range(steps):
        model[0].zero_grad_buffer()
        optimizer.zero_grad()
        model[0](tokens, positions, None, labels=tokens.roll(-1, 1)).mean().backward()
        ok, norm, _ = optimizer.step()
        assert ok
        norms.append(norm)
    return [p.detach().clone() for p in model[0].parameters()], norms, optimizer


@pytest.mark.usefixtures("megatron_world")
def test_megatron_holds_torch_adamw_with_the_kernel_and_keeps_megatrons_numerics(monkeypatch):
    reference, ref_norms, _ = _trained(None, True, monkeypatch)
    monkeypatch.undo()
    params, norms, optimizer = _trained(FOREACH, False, monkeypatch)
    inners = list(torch_adams(optimizer))
    assert inners and all(type(inner) is torch.optim.AdamW for inner in inners)
    assert all(g["foreach"] and not g["fused"] for inner in inners for g in inner.param_groups)
    # foreach on a CPU: bit for bit megatron's optimizer; clipping was active
    assert norms == ref_norms and min(norms) > 0.05
    assert all(torch.equal(p, r) for p, r in zip(params, reference))
    # the fused kernel (CUDA's choice; torch has one on CPU too): one update within an FP32
    # rounding, so a BF16 weight at most one BF16 ulp off, or (where the update cancels the
    # weight to ~0) an FP32 rounding of lr; later steps amplify it (Adam divides by sqrt(v))
    reference, ref_norms, _ = _trained(None, True, monkeypatch, steps=1)
    monkeypatch.undo()
    params, norms, optimizer = _trained(FUSED, False, monkeypatch, steps=1)
    inner = next(torch_adams(optimizer))
    assert all(g["fused"] for g in inner.param_groups)
    assert norms == ref_norms
    assert any(not torch.equal(p, r) for p, r in zip(params, reference))
    for p, r in zip(params, reference):
        assert torch.allclose(p.float(), r.float(), rtol=2.0**-7, atol=1e-8)
    state = inner.state[inner.param_groups[0]["params"][0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"].item() == 1


def test_a_resumed_bf16_run_matches_the_uninterrupted_one_bit_for_bit(tmp_path):
    flags = [*FAST_ARGS, "--bf16", "--train-iters", "4"]
    launch([*flags, "--save-interval", "2", "--run-dir", str(tmp_path / "full"),
            "--save", str(tmp_path / "ckpt")])
    launch([*flags, "--run-dir", str(tmp_path / "resumed"), "--no-save",
            "--load", str(tmp_path / "ckpt" / "iter_0000002")])
    full = train_losses(tmp_path / "full")
    assert train_losses(tmp_path / "resumed") == {3: full[3], 4: full[4]}
