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


def _counting(monkeypatch, *names):
    """Record the weight-shaped tensors handed to ``gemm.<name>`` (fake_quant / to_fp8 /
    to_fp8_pair)."""
    seen = []

    def spy(original):
        def counted(t, fmt, *args, **kw):
            if t.shape in ((144, 256), (256, 144)):
                seen.append(tuple(t.shape))
            return original(t, fmt, *args, **kw)
        return counted

    for name in names:
        monkeypatch.setattr(gemm, name, spy(getattr(gemm, name)))
    return seen


@pytest.mark.parametrize("formats,real,spied,per_step", [
    (UNIFORM["fp8"], False, "fake_quant", 1),  # 128x128 blocks: once for fprop and dgrad
    (UNIFORM["fp4-tensor"], False, "fake_quant", 1),
    (TILES, False, "fake_quant", 2 * MICRO_BATCHES),  # not kept by backward: not cached
    (PER_TENSOR_FP8, True, ("to_fp8", "to_fp8_pair"), 1),  # real: one cast for fprop, dgrad
])
def test_a_step_quantizes_fprops_weight_once_and_trains_the_same(formats, real, spied,
                                                                  per_step, monkeypatch):
    w, batches = _batches()
    reference = _step(w, batches, formats, real, None)
    seen = _counting(monkeypatch, *((spied,) if isinstance(spied, str) else spied))
    reuse = WeightReuse(MICRO_BATCHES)
    cache = WeightCache(reuse)
    got = _step(w, batches, formats, real, cache)
    assert len(seen) == per_step
    assert not cache.entries and not cache.backward_entries  # the last forward, backward
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


PER_ROW_FP8 = SiteFormats("fp8_e4m3@row", "fp8_e4m3@row", "fp8_e5m2@row")


def _pipelined_step(w, batches, formats, cache, order):
    """One step whose forwards and backwards run in ``order`` ("f0", "b0", ...: a pipeline
    schedule's order on one stage); outputs, dx and the accumulated dw."""
    w = w.clone().requires_grad_()
    xs = [x.clone().requires_grad_() for x, _ in batches]
    ys = {}
    for event in order:
        i = int(event[1:])
        if event[0] == "f":
            if cache is not None:
                cache.start_forward()
            ys[i] = quantized_gemm(xs[i], w, None, resolve(formats), real=True, cache=cache)
        else:
            ys[i].backward(batches[i][1])
    return [t for i in range(len(xs)) for t in (ys[i].detach(), xs[i].grad)] + [w.grad]


ORDERS = {
    "in turn": ["f0", "b0", "f1", "b1", "f2", "b2"],
    "1F1B, 2 warm-up forwards": ["f0", "f1", "f2", "b0", "b1", "b2"],
    "1F1B, 1 warm-up forward": ["f0", "f1", "b0", "f2", "b1", "b2"],
}


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("formats,per_step", [(PER_TENSOR_FP8, 1), (PER_ROW_FP8, 2)],
                         ids=["per tensor", "per row"])
def test_real_fp8_weights_and_transposes_once_per_step(formats, per_step, order, monkeypatch):
    """Real FP8: fprop's q(w) and dgrad's q(w) along N made once a step (per tensor: one cast
    writes both layouts; per row: two quantizations), whatever the schedule's order of the
    micro-batches' forwards and backwards; bit for bit the step that quantizes each GEMM's
    weight afresh; nothing held after the step's last backward."""
    w, batches = _batches(3)
    reference = _pipelined_step(w, batches, formats, None, ORDERS[order])
    seen = _counting(monkeypatch, "to_fp8", "to_fp8_pair")
    cache = WeightCache(WeightReuse(MICRO_BATCHES))
    got = _pipelined_step(w, batches, formats, cache, ORDERS[order])
    assert len(seen) == per_step
    assert not cache.entries and not cache.backward_entries
    for g, r in zip(got, reference):
        assert torch.equal(g, r)


def test_one_micro_batch_dgrad_reads_fprops_fp8_weight_transposed(monkeypatch):
    """A step of one micro-batch quantizes a per-tensor weight once for fprop and dgrad."""
    w, batches = _batches(4)
    reference = _step(w, batches[:1], PER_TENSOR_FP8, True, None)
    seen = _counting(monkeypatch, "to_fp8", "to_fp8_pair")
    cache = WeightCache(WeightReuse(1))
    got = _step(w, batches[:1], PER_TENSOR_FP8, True, cache)
    assert seen == [(144, 256)]
    for g, r in zip(got, reference):
        assert torch.equal(g, r)


def test_a_forward_without_autograd_keeps_nothing_for_dgrad():
    """Evaluation (no_grad): fprop's q(w) only, and no transposed copy for a backward."""
    w, batches = _batches(5)
    cache = WeightCache(WeightReuse(MICRO_BATCHES))
    with torch.no_grad():
        cache.start_forward()
        quantized_gemm(batches[0][0], w, None, resolve(PER_TENSOR_FP8), real=True, cache=cache)
    assert len(cache.entries) == 1 and not cache.backward_entries


def test_real_fp8_entries_of_an_unfinished_step_are_not_used_after_new_weights():
    """Forwards whose backwards never ran (an aborted step) leave dgrad's q(w).T behind; after
    new weights the next step matches quantizing afresh, bit for bit."""
    w, batches = _batches(6)
    reuse = WeightReuse(MICRO_BATCHES)
    cache = WeightCache(reuse)
    for x, _ in batches[:2]:
        cache.start_forward()
        quantized_gemm(x.clone().requires_grad_(), w.clone().requires_grad_(), None,
                       resolve(PER_TENSOR_FP8), real=True, cache=cache)
    assert cache.backward_entries  # held for backwards that do not come
    reuse.new_weights()
    w2 = w * 1.5
    order = ORDERS["1F1B, 1 warm-up forward"]
    got = _pipelined_step(w2, batches, PER_TENSOR_FP8, cache, order)
    for g, r in zip(got, _pipelined_step(w2, batches, PER_TENSOR_FP8, None, order)):
        assert torch.equal(g, r)
