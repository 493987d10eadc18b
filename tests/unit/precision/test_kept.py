"""The bytes the dry run says quantized GEMMs keep beyond megatron's linears
(:mod:`megatron_ext.precision.kept`), against what a real model holds after a forward: every
storage saved for the backward (saved-tensor hooks) and the weight caches' entries, less
what the same model holds with every site passthrough (megatron's own linears)."""

import pytest
import torch

from megatron_ext.formats.fp8 import Fp8Operand
from megatron_ext.precision.cost import ModelShape
from megatron_ext.precision.kept import KeptBytes, SiteGeometry, kept_bytes, site_geometry
from megatron_ext.precision.layers import (apply_plan, cache_weights, quantized_linear_classes,
                                           quantized_linears)
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.policies import UNIFORM
from megatron_ext.precision.site_formats import SiteFormats, resolve
from megatron_ext.precision.weight_cache import WeightReuse

from precision_helpers import megatron_world  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("megatron_world")

SEQ, BATCH = 16, 2
FP8_TENSOR = SiteFormats("fp8_e4m3", "fp8_e4m3", "fp8_e4m3")
CASES = {  # formats, --fp8-execution
    "uniform:fp8 emulated": (UNIFORM["fp8"], "emulated"),  # 128x128 w: q(w) kept
    "per-tensor emulated": (FP8_TENSOR, "emulated"),  # q(w) and q(x) (x's size) kept
    "per-tensor real": (FP8_TENSOR, "real"),  # q(x) kept in FP8, proj's on top of x
    "uniform:fp8 real": (UNIFORM["fp8"], "real"),  # tile x: x kept, w not
    "mxfp8 emulated": (SiteFormats("mxfp8", "mxfp8", "mxfp8"), "emulated"),  # 1x32: nothing
    "bf16 cast of fp32": (UNIFORM["bf16"], "emulated"),  # a cast that changes w: a copy
}


@pytest.fixture(scope="module")
def model(megatron_world):
    from megatron_ext.training import model as model_lib
    from megatron_ext.training.arguments import parse_args

    args = parse_args("llama", ["--mock-data", "--num-layers", "2", "--seq-length", str(SEQ),
                                "--micro-batch-size", str(BATCH), "--global-batch-size",
                                str(BATCH)], world_size=1)
    config = model_lib.transformer_config(args)
    return args, model_lib.build_model_chunks(args, config, 512, quantized_linear_classes())


def _held_bytes(chunks) -> int:
    """Bytes of every storage one forward saves for the backward, plus the caches' entries,
    but the parameters' (the model state, held either way)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tokens = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        chunks[0](tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)
    for module in quantized_linears(chunks).values():
        cache = module.weight_cache
        for entry in ([*cache.entries.values(), *cache.backward_entries.values()] if cache
                      else ()):
            saved.extend(entry[:2] if isinstance(entry, Fp8Operand) else [entry])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    for param in chunks[0].parameters():
        storages.pop(param.untyped_storage().data_ptr(), None)
    return sum(storages.values())


def _estimate(args, formats: SiteFormats, real: bool, cached: bool) -> float:
    shape = ModelShape.from_args(args)
    total = 0.0
    for site in ("qkv", "proj", "fc1", "fc2"):
        geometry = site_geometry(shape, site, SEQ * BATCH, 1, False, fused_attention=True)
        kept = kept_bytes(resolve(formats), geometry, torch.float32, real, cached, 2)
        total += kept.per_step + kept.per_micro_batch
    return total * args.num_layers


@pytest.mark.parametrize("cached", [False, True], ids=["one micro-batch", "weight cache"])
@pytest.mark.parametrize("case", list(CASES))
def test_what_a_forward_keeps_is_what_the_dry_run_counts(model, case, cached):
    args, chunks = model
    formats, execution = CASES[case]
    linears = quantized_linears(chunks)
    plain = _held_bytes(chunks)
    apply_plan(chunks, PrecisionPlan({sid: formats for sid in linears}), args.num_layers)
    for module in linears.values():
        module.fp8_execution = execution
    cache_weights(chunks, WeightReuse(micro_batches=2) if cached else None)
    try:
        held = _held_bytes(chunks) - plain
    finally:
        apply_plan(chunks, PrecisionPlan({}), args.num_layers)
        cache_weights(chunks, None)
        for module in linears.values():
            del module.fp8_execution  # back to the class's
    # the estimate leaves out the FP8 scales: 4 bytes per tensor-scaled operand kept
    scales = 4 * len(linears) * (1 + cached) if case == "per-tensor real" else 0
    assert held == _estimate(args, formats, execution == "real", cached) + scales
    assert held != 0 or case.startswith(("mxfp8", "uniform:fp8 real"))


def test_sequence_parallel_keeps_a_column_layers_rows_and_fp8_halves_x():
    """The geometry of TP=4 with SP: a column layer keeps T/4 rows of x (in FP8: one byte a
    value instead of two), a row layer all T rows of its K/4 inputs; proj's FP8 copy after
    fused attention comes on top of the x attention keeps."""
    shape = ModelShape(1, 512, 1024, 8, 8, True, 0)
    geo = {s: site_geometry(shape, s, 2048, 4, True, True) for s in ("qkv", "proj", "fc2")}
    assert geo["qkv"] == SiteGeometry(2048, 1536 // 4, 512, 512, False)
    assert geo["proj"] == SiteGeometry(2048, 512, 128, 2048, True)
    assert geo["fc2"] == SiteGeometry(2048, 512, 256, 2048, False)
    ops = resolve(FP8_TENSOR)
    bf16 = torch.bfloat16
    assert kept_bytes(ops, geo["qkv"], bf16, True, False, 2) == KeptBytes(0.0, -512 * 512)
    # the weight cache: fprop's q(w) and dgrad's (its transpose), one byte a weight each
    assert kept_bytes(ops, geo["proj"], bf16, True, True, 2) == KeptBytes(2 * 512 * 128, 2048 * 128)
    assert kept_bytes(ops, geo["proj"], bf16, True, True, 1) == KeptBytes(512 * 128, 2048 * 128)
    assert kept_bytes(ops, geo["fc2"], bf16, False, False, 2) == KeptBytes(0.0, 512 * 256 * 2)
    assert kept_bytes(ops, geo["fc2"], bf16, False, True, 2) == KeptBytes(512 * 256 * 2, 0.0)
