"""Put a dry run together: vocabulary, stages on meta, estimates, the extensions' parts."""

from __future__ import annotations

import time

from megatron_ext.training.dry_run import estimates as est
from megatron_ext.training.dry_run.meta import StageParams, build_stages
from megatron_ext.training.dry_run.parts import (DryRunContext, collect, extra_memory, moments,
                                                 stage_times)
from megatron_ext.training.dry_run.report import REPORT_KEYS, DryRunReport, StageReport
from megatron_ext.errors import UsageError
from megatron_ext.extension import the_one
from megatron_ext.training.layer_impl import resolve_transformer_impl


def unpadded_vocab(args) -> int:
    """The vocabulary the job would use, without building its data (``training/data.py``)."""
    from megatron_ext.data.corpus import DEFAULT_VOCAB_SIZE
    from megatron_ext.data.tokenizer import ByteTokenizer, build_tokenizer

    if args.data_path and args.tokenizer_model is None:
        raise UsageError("--data-path needs --tokenizer-model (the tokenizer.json, or 'byte', "
                         "the data was preprocessed with)")
    if args.vocab_size is not None:
        return args.vocab_size
    if args.tokenizer_model is None:
        return ByteTokenizer().vocab_size if args.mock_data else DEFAULT_VOCAB_SIZE
    try:
        return build_tokenizer(args.tokenizer_model, args.eod_token).vocab_size
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc).splitlines()[0]) from None


def gpu_job_impl(args, extensions) -> str:
    """The layer implementation the GPU job will get: the real run's decision
    (:func:`~megatron_ext.training.layer_impl.resolve_transformer_impl`) for the extensions'
    linears and the attention backend, on a node with Transformer Engine; ``UsageError`` where
    the job would refuse (a backend those layers cannot run too)."""
    custom = the_one(list(extensions), "linear_classes", args) is not None
    impl = resolve_transformer_impl(args.transformer_impl, custom, te_available=True,
                                    attention_backend=args.attention_backend)
    est.attention_of(args, impl)
    return impl


def _stage(args, p: StageParams, layout, vocab: int, parts,
           seconds: float | None) -> StageReport:
    given = moments(parts)
    w, g, o = est.model_state_bytes(p.per_gpu, layout,
                                    given.moments[p.stage] if given else None)
    act = est.activation_bytes(p.stage, len(p.layers), args.hidden_size,
                               args.num_attention_heads, vocab, layout)
    return StageReport(p, est.Memory(w, g, o, act, extra_memory(parts, p.stage)),
                       est.in_flight(p.stage, layout), seconds)


def _header(args, layout) -> str:
    optimizer = "distributed optimizer" if layout.distributed_optimizer else "optimizer per DP"
    return (f"dry run: {args.family} '{args.model}' | {args.world_size} GPUs = TP {layout.tp} x "
            f"PP {layout.pp} x DP {layout.dp}" + (f" (VP {layout.vp})" if layout.vp > 1 else "")
            + f" | micro-batch {layout.micro_batch} x {layout.micro_batches} per DP rank = "
            f"global batch {args.global_batch_size}, seq {layout.seq} | "
            f"{'BF16' if layout.bf16 else 'FP32'} params, {optimizer}"
            + (", SP" if layout.sequence_parallel else ""))


def assemble(args, req, extensions=()) -> DryRunReport:
    """Every number of the report (see the package docstring)."""
    from megatron_ext.training import model

    impl = gpu_job_impl(args, extensions)
    padded = model.padded_vocab_size(unpadded_vocab(args), args)
    layout = est.Layout.from_args(args, impl)
    start = time.perf_counter()
    stages = build_stages(args, padded)
    build_seconds = time.perf_counter() - start
    context = DryRunContext(layout, tuple(stages), padded, args.dry_run_bf16_tflops * 1e12)
    parts = collect(list(extensions), args, context, REPORT_KEYS)
    times = stage_times(parts)
    seconds = list(times.seconds) if times else [None] * len(stages)
    reports = [_stage(args, p, layout, padded, parts, seconds[p.stage]) for p in stages]
    step = est.step_time(seconds, layout) if times else None
    total = sum(p.distinct - p.shared for p in stages)
    return DryRunReport(
        _header(args, layout), total, reports, est.bubble_fraction(layout), step,
        args.global_batch_size * args.seq_length / step if times else None,
        args.dry_run_gpu_memory_gib * est.GIB, build_seconds,
        _notes(args, req, layout, padded, parts, impl), parts)


def _activation_formula(layout) -> str:
    per_token = "34" if layout.flash_attention else "(34 + 5·a·s/h)"
    if layout.tp == 1 or layout.sequence_parallel:
        return f"s·b·h·{per_token}" + ("/t" if layout.tp > 1 else "")
    return "s·b·h·(10 + 24/t" + ("" if layout.flash_attention else " + 5·a·s/(h·t)") + ")"


def _notes(args, req, layout, vocab: int, parts, impl: str) -> list[str]:
    """Assumptions behind the numbers, one line each (formulas: ``estimates.py``), then the
    parts' notes."""
    times = stage_times(parts)
    per_layer = est.layer_activation_bytes(args.hidden_size, args.num_attention_heads, layout)
    zero = f" / DP {layout.dp}" if layout.distributed_optimizer or layout.fsdp else ""
    layout_impl = impl
    if args.transformer_impl == "auto":
        impl += (" (auto, as on a GPU node with Transformer Engine)" if impl != "local" else
                 " (auto: an extension's linears or the attention backend need megatron-core's "
                 "local layers)")
    impl += f", attention {est.attention_of(args, layout_impl)}"
    attention = (f"layers {impl}: fused attention keeps no s x s scores"
                 if layout.flash_attention else f"layers {impl}: the s x s scores of the "
                 "unfused attention (5·a·s/h) included")
    given = moments(parts)
    state = (f"{given.moments_how}{' + FP32 main params 4 B/param' if layout.bf16 else ''}"
             if given else f"Adam m, v{' + FP32 main params' if layout.bf16 else ''} "
             f"{12 if layout.bf16 else 8} B/param")
    out = [
        f"simulated {args.world_size} ranks in one process (torch fake process group); "
        f"parameters from the real megatron-core modules on the meta device; vocabulary "
        f"{vocab} after padding",
        f"memory per GPU: weights {2 if layout.bf16 else 4} B/param, grads 4 B/param (FP32 "
        f"buffer), {state}{zero}" + (" (FSDP: all three / DP)" if layout.fsdp else ""),
        f"activations (Korthikanti et al. 2022, Table 2): {_activation_formula(layout)} bytes = "
        f"{per_layer / est.GIB:.2f} GiB per layer per micro-batch, {attention}; 'mb' = "
        f"micro-batches held at the {'interleaved ' if layout.vp > 1 else ''}1F1B peak; the "
        f"last stage adds FP32 logits 4·s·b·v/t",
        (f"time: 't/mb' = {times.how}; step = (v·m + p - 1)·max(t/mb)/v, " if times
         else "time: ") + "bubble (p - 1)/(v·m + p - 1)",
        *(note for part in parts.values() for note in part.notes),
    ]
    if req.bf16 is None:
        out.append("--bf16 not given: on, the GPU job's default")
    return out
