"""Quantized megatron linears: bitwise megatron in passthrough, the quantized GEMM otherwise,
formats switched between calls without a rebuild; a whole model gets every site labelled,
a plan applied, and the cost model's shapes match the modules."""

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig

from megatron_ext.precision.cost import ModelShape
from megatron_ext.precision.gemm import RecomputableWeight, quantized_gemm
from megatron_ext.precision.layers import (
    quantized_class,
    quantized_linear_classes,
    quantized_linears,
)
from megatron_ext.precision.layers import apply_plan
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.sites import SITES
from megatron_ext.precision.site_formats import SiteFormats, resolve

from precision_helpers import megatron_world  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("megatron_world")

H, F = 96, 160


def _config(bias: bool) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=F,
                             num_attention_heads=4, add_bias_linear=bias,
                             use_cpu_initialization=True, tensor_model_parallel_size=1,
                             pipeline_model_parallel_size=1, gradient_accumulation_fusion=False)


def _pair(base, bias: bool, **kw):
    """(megatron's layer, the quantized one with the same weights)."""
    size_in, size_out = (H, F) if base is ColumnParallelLinear else (F, H)
    make = lambda cls: cls(size_in, size_out, config=_config(bias),
                           init_method=torch.nn.init.normal_, bias=bias, **kw)
    ref, quant = make(base), make(quantized_class(base, 0, "fc1"))
    quant.load_state_dict(ref.state_dict())
    return ref, quant


def _step(layer, x, dy):
    x = x.clone().requires_grad_()
    out, out_bias = layer(x)
    if out_bias is not None:  # skip_bias_add: the caller adds it (megatron fuses it later)
        out = out + out_bias
    out.backward(dy)
    params = [p.grad for p in layer.parameters()]
    return [out.detach(), x.grad, *params]


KINDS = [(ColumnParallelLinear, {"skip_bias_add": False}),
         (ColumnParallelLinear, {"skip_bias_add": True}),
         (RowParallelLinear, {"input_is_parallel": True, "skip_bias_add": False})]


@pytest.mark.parametrize("base,kw", KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_passthrough_is_bitwise_megatron(base, kw, bias):
    ref, quant = _pair(base, bias, **kw)
    assert resolve(quant.formats).passthrough
    x = torch.randn(7, 3, ref.input_size)
    dy = torch.randn(7, 3, ref.output_size)
    for r, q in zip(_step(ref, x, dy), _step(quant, x, dy), strict=True):
        assert torch.equal(r, q)


@pytest.mark.parametrize("base,kw", KINDS)
def test_formats_switch_between_calls_without_rebuild(base, kw):
    _, quant = _pair(base, False, **kw)
    x = torch.randn(7, 3, quant.input_size)
    dy = torch.randn(7, 3, quant.output_size)
    plain = _step(quant, x, dy)
    for formats in (UNIFORM["fp8"], UNIFORM["fp4"]):
        quant.formats = formats  # takes effect on the next call
        quant.zero_grad()
        torch.manual_seed(0)
        got = _step(quant, x, dy)
        xs, ws = x.clone().requires_grad_(), quant.weight.detach().clone().requires_grad_()
        torch.manual_seed(0)
        ref = quantized_gemm(xs, ws, None, resolve(formats))
        ref.backward(dy)
        for g, r in zip(got, (ref.detach(), xs.grad, ws.grad), strict=True):
            assert torch.equal(g, r)
        assert not torch.equal(got[0], plain[0])
    quant.formats = SiteFormats()
    quant.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(_step(quant, x, dy), plain, strict=True))


@pytest.fixture(scope="module")
def tiny_model(megatron_world):
    from megatron_ext.training import model as model_lib
    from megatron_ext.training.arguments import parse_args

    args = parse_args("llama", ["--mock-data", "--num-layers", "3", "--global-batch-size", "8",
                                "--micro-batch-size", "8"], world_size=1)
    config = model_lib.transformer_config(args)
    chunks = model_lib.build_model_chunks(args, config, 512, quantized_linear_classes())
    return args, chunks


def test_every_site_is_a_labelled_quantized_megatron_linear(tiny_model):
    _, chunks = tiny_model
    linears = quantized_linears(chunks)
    assert sorted(linears) == sorted(f"L{i}.{s}" for i in range(3) for s in SITES)
    attn = chunks[0].decoder.layers[1].self_attention
    assert linears["L1.qkv"] is attn.linear_qkv and isinstance(attn.linear_qkv,
                                                                ColumnParallelLinear)
    assert isinstance(linears["L2.fc2"], RowParallelLinear)
    # the output layer stays megatron's own
    assert type(chunks[0].output_layer) is ColumnParallelLinear


def test_cost_model_shapes_are_the_modules_shapes(tiny_model):
    args, chunks = tiny_model
    shape = ModelShape.from_args(args)
    for sid, module in quantized_linears(chunks).items():
        assert shape.site_nk(sid.split(".")[1]) == (module.output_size, module.input_size), sid


def test_apply_plan_sets_each_site(tiny_model):
    args, chunks = tiny_model
    plan = PrecisionPlan({"L0.qkv": UNIFORM["fp4"], "L2.fc1": UNIFORM["fp8"]})
    assert apply_plan(chunks, plan, args.num_layers) == 12
    linears = quantized_linears(chunks)
    assert linears["L0.qkv"].formats == UNIFORM["fp4"]
    assert linears["L2.fc1"].formats == UNIFORM["fp8"]
    assert linears["L1.proj"].formats == SiteFormats()  # unlisted: unquantized
    tokens = torch.randint(0, 512, (2, 16))
    loss = chunks[0](tokens, torch.arange(16).expand(2, 16), None, labels=tokens).mean()
    loss.backward()
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="unknown site L3.qkv"):
        apply_plan(chunks, PrecisionPlan({"L3.qkv": UNIFORM["fp8"]}), args.num_layers)


def test_only_projs_input_is_kept_by_its_producer_so_only_proj_keeps_it(tiny_model):
    """Per-tensor / cast formats let a GEMM keep q(x) for wgrad instead of x; that saves
    memory only where nothing else keeps x. Counted with saved-tensor hooks over a forward
    (SDPA, the default attention): proj's input is saved twice (SDPA's output, and proj
    itself: ``own_input`` False), every other site's not at all (they keep q(x))."""
    args, chunks = tiny_model
    apply_plan(chunks, PrecisionPlan({sid: UNIFORM["bf16"] for sid in quantized_linears(chunks)}),
               args.num_layers)  # an FP32 model: the BF16 cast is a real quantization
    inputs, saved = {}, []
    hooks = [m.register_forward_pre_hook(lambda mod, inp, sid=sid: inputs.update({sid: inp[0]}))
             for sid, m in quantized_linears(chunks).items()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            tokens = torch.randint(0, 512, (2, 16))
            chunks[0](tokens, torch.arange(16).expand(2, 16), None)
    finally:
        for hook in hooks:
            hook.remove()
        apply_plan(chunks, PrecisionPlan({}), args.num_layers)
    storages = [t.untyped_storage().data_ptr() for t in saved]
    kept = {sid: storages.count(x.untyped_storage().data_ptr()) for sid, x in inputs.items()}
    assert kept == {sid: 2 if sid.endswith("proj") else 0 for sid in inputs}


@pytest.mark.parametrize("formats", [SiteFormats(), UNIFORM["fp8"]])
def test_operand_transforms_run_beneath_the_plan(formats):
    """A transform's weight is what the GEMM (and the plan's quantization) sees; autograd
    flows through the transform to the real weight."""
    _, quant = _pair(ColumnParallelLinear, False, skip_bias_add=False)
    _, doubled = _pair(ColumnParallelLinear, False, skip_bias_add=False)
    with torch.no_grad():
        doubled.weight.copy_(2.0 * quant.weight)
    quant.formats = doubled.formats = formats
    quant.transforms = (lambda module, x, w: (x, 2.0 * w),)
    x, dy = torch.randn(5, 2, H), torch.randn(5, 2, F)
    torch.manual_seed(0)
    got = _step(quant, x, dy)
    torch.manual_seed(0)
    want = _step(doubled, x, dy)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2], 2.0 * want[2])  # d(2w)/dw = 2


@pytest.mark.parametrize("formats", [
    SiteFormats(), UNIFORM["fp8"],  # passthrough; dgrad reuses fprop's q(w)
    SiteFormats("fp8_e4m3@tile128", "fp8_e4m3@tile128", "fp8_e4m3@tile128")])  # afresh
def test_a_recomputable_weight_is_rebuilt_in_the_backward_not_kept(formats):
    """A transform returning a RecomputableWeight: the same output and gradients, bit for
    bit, as returning the tensor; the GEMM keeps the source, and rebuilds once (for dgrad)."""
    _, kept = _pair(ColumnParallelLinear, False, skip_bias_add=False)
    _, rebuilt = _pair(ColumnParallelLinear, False, skip_bias_add=False)
    rebuilt.load_state_dict(kept.state_dict())
    calls = []

    def rebuild(w):
        calls.append(w)
        return w * 1.5 + 0.25

    kept.transforms = (lambda module, x, w: (x, w * 1.5 + 0.25),)
    rebuilt.transforms = (lambda module, x, w: (x, RecomputableWeight(w * 1.5 + 0.25, w, rebuild)),)
    kept.formats = rebuilt.formats = formats
    x, dy = torch.randn(5, 2, H), torch.randn(5, 2, F)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        got = _step(rebuilt, x, dy)
    ptr = rebuilt.weight.untyped_storage().data_ptr()
    assert len(calls) == 1 and calls[0].untyped_storage().data_ptr() == ptr  # the parameter
    assert all(t.untyped_storage().data_ptr() == ptr for t in saved
               if t.shape == rebuilt.weight.shape)  # no copy of w or ŵ kept
    for a, b in zip(got, _step(kept, x, dy), strict=True):
        assert torch.equal(a, b)


def test_observed_pass_isolates_the_rng_and_always_detaches(tiny_model):
    from types import SimpleNamespace

    from megatron_ext.precision.observe import observed_pass
    _, model = tiny_model
    linears = quantized_linears(model)
    seen = []

    def observer(module, input, weight, kwargs):
        seen.append(module.site_id)
        return quantized_gemm(input, weight, None, resolve(SiteFormats()))

    def replay(consumed):
        torch.rand(3)  # draws inside the pass must not shift the caller's stream
        x = torch.randn(4, 1, linears["L0.qkv"].input_size)
        return float(linears["L0.qkv"](x)[0].sum())

    before = torch.get_rng_state()
    run = SimpleNamespace(model=model, replay=replay)
    first = observed_pass(run, {"L0.qkv": observer}, 0, seed=7)
    assert torch.equal(torch.get_rng_state(), before) and seen == ["L0.qkv"]
    assert observed_pass(run, {"L0.qkv": observer}, 0, seed=7) == first  # seeded by the caller
    assert linears["L0.qkv"].observer is None

    def broken(consumed):
        raise RuntimeError("pass failed")

    with pytest.raises(RuntimeError):
        observed_pass(SimpleNamespace(model=model, replay=broken), {"L0.qkv": observer},
                      0, seed=7)
    assert linears["L0.qkv"].observer is None
