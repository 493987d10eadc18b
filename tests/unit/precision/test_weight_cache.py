"""Fprop's quantized weight made once per step (precision/weight_cache.py): counted
quantizations, results bit for bit those of quantizing in every micro-batch, nothing held
after a step's last forward, and a new generation after the weights change."""

import pytest
import torch

from megatron_ext.precision import gemm
from megatron_ext.precision.gemm import quantized_gemm
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats, resolve
from megatron_ext.precision.weight_cache import WeightCache, WeightReuse

MICRO_BATCHES = 3
TILES = SiteFormats("fp8_e4m3@tile128", "fp8_e4m3@tile128", "fp8_e4m3@tile128")
PER_TENSOR_FP8 = SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e5m2")


def _batches(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(144, 256, generator=g) * 0.05
    batches = [(torch.randn(4, 32, 256, generator=g), torch.randn(4, 32, 144, generator=g))
               for _ in range(MICRO_BATCHES)]
    return w.to(device), [(x.to(device), dy.to(device)) for x, dy in batches]


def _step(w, batches, formats, real, cache):
    """One step's micro-batches: outputs, dx and the accumulated dw."""
    w = w.clone().requires_grad_()
    outs = []
    for x, dy in batches:
        x = x.clone().requires_grad_()
        if cache is not None:
            cache.start_forward()
        y = quantized_gemm(x, w, None, resolve(formats), real=real, cache=cache)
        y.backward(dy)
        outs += [y.detach(), x.grad]
    return outs + [w.grad]


def _counting(monkeypatch, name):
    """Record the weight-shaped tensors handed to ``gemm.<name>`` (fake_quant / to_fp8)."""
    seen = []
    original = getattr(gemm, name)

    def spy(t, fmt, *args, **kw):
        if t.shape in ((144, 256), (256, 144)):
            seen.append(tuple(t.shape))
        return original(t, fmt, *args, **kw)

    monkeypatch.setattr(gemm, name, spy)
    return seen


@pytest.mark.parametrize("formats,real,spied,per_step", [
    (UNIFORM["fp8"], False, "fake_quant", 1),  # 128x128 blocks: once for fprop and dgrad
    (UNIFORM["fp4-tensor"], False, "fake_quant", 1),
    (TILES, False, "fake_quant", 2 * MICRO_BATCHES),  # not kept by backward: not cached
    (PER_TENSOR_FP8, True, "to_fp8", 1 + MICRO_BATCHES),  # real: fprop's once, dgrad's each
])
def test_a_step_quantizes_fprops_weight_once_and_trains_the_same(formats, real, spied,
                                                                  per_step, monkeypatch):
    w, batches = _batches()
    reference = _step(w, batches, formats, real, None)
    seen = _counting(monkeypatch, spied)
    reuse = WeightReuse(MICRO_BATCHES)
    cache = WeightCache(reuse)
    got = _step(w, batches, formats, real, cache)
    assert len(seen) == per_step
    assert not cache.entries  # the step's last forward let go
    for g, r in zip(got, reference):
        assert torch.equal(g, r)


def test_a_new_generation_sees_the_new_weights():
    w, batches = _batches(1)
    reuse = WeightReuse(MICRO_BATCHES)
    cache = WeightCache(reuse)
    cache.start_forward()
    quantized_gemm(batches[0][0], w, None, resolve(UNIFORM["fp8"]), cache=cache)
    assert len(cache.entries) == 1
    w.data.mul_(2)  # as megatron's optimizer writes: no version counter sees it
    reuse.new_weights()
    got = _step(w, batches, UNIFORM["fp8"], False, cache)
    for g, r in zip(got, _step(w, batches, UNIFORM["fp8"], False, None)):
        assert torch.equal(g, r)
    stale = WeightCache(WeightReuse(MICRO_BATCHES + 1))  # a generation that did not advance
    stale.start_forward()
    before = quantized_gemm(batches[0][0], w, None, resolve(UNIFORM["fp8"]), cache=stale)
    w.data.mul_(2)
    stale.start_forward()
    after = quantized_gemm(batches[0][0], w, None, resolve(UNIFORM["fp8"]), cache=stale)
    assert torch.equal(before, after)  # what the generation guards against


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton and FP8 paths of CUDA")
@pytest.mark.parametrize("formats,real", [(UNIFORM["fp8"], False), (UNIFORM["fp4-tensor"], False),
                                          (PER_TENSOR_FP8, True), (UNIFORM["fp8"], True)])
def test_on_cuda_a_cached_step_is_the_uncached_one(formats, real):
    w, batches = _batches(2, "cuda")
    cache = WeightCache(WeightReuse(MICRO_BATCHES))
    for g, r in zip(_step(w, batches, formats, real, cache),
                    _step(w, batches, formats, real, None)):
        assert g.is_cuda and torch.equal(g, r)
