"""Checks of the parsed training flags: each bad value is one ``UsageError`` line naming the
flag (``validate_args``, called by :func:`.arguments.parse_args`)."""

from __future__ import annotations

import argparse
import math
import re

from megatron_ext.errors import UsageError
from megatron_ext.training.attention_backend import resolve_attention_backend


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise UsageError(message)


def _validate_rope_and_activation(args: argparse.Namespace) -> None:
    """--use-rope-scaling needs RoPE and a positive factor; --openai-gelu needs a GeLU MLP."""
    _check(not args.use_rope_scaling or args.position_embedding_type == "rope",
           "--use-rope-scaling needs --position-embedding-type rope")
    _check(args.rope_scaling_factor > 0, "--rope-scaling-factor must be positive")
    _check(not (args.openai_gelu and args.swiglu),
           "--openai-gelu selects the GeLU of a GeLU MLP; --swiglu uses SiLU (pass --no-swiglu)")


def _validate_fsdp(args: argparse.Namespace) -> None:
    """The FSDP flags' rules (docs/parallelism.md; Megatron-LM enforces the same two for FSDP2)."""
    _check(not (args.use_torch_fsdp2 and args.use_megatron_fsdp),
           "--use-torch-fsdp2 and --use-megatron-fsdp exclude each other")
    if not args.use_torch_fsdp2:
        return
    _check(not args.use_distributed_optimizer,
           "--use-torch-fsdp2 shards the optimizer state itself: drop --use-distributed-optimizer")
    _check(bool(args.untie_embeddings_and_output_weights),
           "--use-torch-fsdp2 needs --untie-embeddings-and-output-weights: a tied output layer "
           "would read the embedding's sharded weight outside its FSDP unit")


def _given(args: argparse.Namespace, name: str) -> str:
    """``--flag VALUE``, and where the value came from when the user did not give it."""
    text = f"--{name.replace('_', '-')} {getattr(args, name)}"
    return f"{text} (the --model {args.model} preset's)" if name in args.from_preset else text


def _validate_split(split: str) -> None:
    """``--split``: up to three comma- or slash-separated weights, each finite and >= 0, the
    train weight positive (megatron-core's own parse turns anything else into NaN)."""
    parts = re.split(r"[,/]", split)
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    _check(1 <= len(parts) <= 3 and len(weights) == len(parts)
           and all(math.isfinite(w) and w >= 0 for w in weights) and weights[0] > 0,
           f"--split {split!r}: expected train,valid,test weights (numbers >= 0, train > 0), "
           "e.g. 969,30,1")


def _validate_intervals(args: argparse.Namespace) -> None:
    """Optional step intervals: unset, or positive (0 would silently mean never)."""
    for name in ("save_interval", "exit_interval", "global_batch_size"):
        value = getattr(args, name)
        _check(value is None or value > 0, f"--{name.replace('_', '-')} must be positive")


def _validate_run_flags(args: argparse.Namespace) -> None:
    """The process group's timeout, checkpoint retention, and the --load path (a file, a
    missing folder, a dangling pointer: one line now, not at load time)."""
    _check(args.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be positive")
    _check(args.save_retain is None or args.save_retain >= 1, "--save-retain must be >= 1")
    if args.load is not None:
        from megatron_ext.training.checkpointing import locate_checkpoint
        locate_checkpoint(args.load)


def validate_args(args: argparse.Namespace) -> None:
    """Every layout / range check, each with its own one-line message."""
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "seq_length", "train_iters", "micro_batch_size",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "log_interval", "eval_interval"):
        _check(getattr(args, name) > 0, f"--{name.replace('_', '-')} must be positive")
    _check(args.eval_iters >= 0, "--eval-iters must be >= 0")
    _validate_intervals(args)
    _validate_split(args.split)
    _check(args.lr >= 0 and args.min_lr >= 0, "--lr and --min-lr must be >= 0")
    _check(args.min_lr <= args.lr, "--min-lr must not exceed --lr")
    _check(0 <= args.hidden_dropout < 1 and 0 <= args.attention_dropout < 1,
           "dropout must be in [0, 1)")
    _check(0 <= args.adam_beta1 < 1 and 0 <= args.adam_beta2 < 1, "Adam betas must be in [0, 1)")
    _check(args.clip_grad >= 0 and args.weight_decay >= 0, "--clip-grad and --weight-decay >= 0")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _check(args.world_size % (tp * pp) == 0,
           f"world size {args.world_size} is not divisible by TP*PP = {tp * pp}")
    args.data_parallel = args.world_size // (tp * pp)
    if args.data_parallel_size is not None:
        _check(args.data_parallel_size == args.data_parallel,
               f"--data-parallel-size {args.data_parallel_size} != world size / (TP*PP) = "
               f"{args.data_parallel}")
    _check(args.num_attention_heads % tp == 0,
           f"TP={tp} does not divide {_given(args, 'num_attention_heads')}")
    _check(args.num_query_groups % tp == 0,
           f"TP={tp} does not divide {_given(args, 'num_query_groups')}")
    _check(args.num_attention_heads % args.num_query_groups == 0,
           f"{_given(args, 'num_query_groups')} does not divide "
           f"{_given(args, 'num_attention_heads')}")
    _check(args.hidden_size % args.num_attention_heads == 0,
           f"{_given(args, 'num_attention_heads')} does not divide "
           f"{_given(args, 'hidden_size')}")
    _check(args.num_layers % pp == 0,
           f"PP={pp} does not divide --num-layers {args.num_layers}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        vp_layers = args.num_layers_per_virtual_pipeline_stage
        _check(pp > 1 and vp_layers > 0 and per_stage % vp_layers == 0,
               "--num-layers-per-virtual-pipeline-stage needs PP > 1 and must divide "
               f"the {per_stage} layers of each stage")
        args.virtual_pipeline_model_parallel_size = per_stage // vp_layers
    _validate_rope_and_activation(args)
    if args.transformer_impl != "auto":  # else resolved with the layers (training/model.py)
        resolve_attention_backend(args.attention_backend, args.transformer_impl)
    _check(not args.sequence_parallel or tp > 1, "--sequence-parallel needs TP > 1")
    _check(not args.sequence_parallel or args.seq_length % tp == 0,
           f"--sequence-parallel needs TP={tp} to divide --seq-length {args.seq_length}")
    if args.position_embedding_type == "learned_absolute":
        _check(args.seq_length <= args.max_position_embeddings,
               f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
               f"{args.max_position_embeddings}")
    per_step = args.micro_batch_size * args.data_parallel
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    _check(args.global_batch_size > 0 and args.global_batch_size % per_step == 0,
           f"--global-batch-size {args.global_batch_size} is not divisible by micro-batch-size"
           f" x data-parallel = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    if args.virtual_pipeline_model_parallel_size is not None:
        _check(args.num_microbatches % pp == 0,
               "the interleaved schedule needs the number of micro-batches to be a multiple "
               "of PP")
    _check(not (args.data_path and args.mock_data), "--data-path and --mock-data exclude each other")
    _validate_run_flags(args)
    _validate_fsdp(args)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = args.lr_decay_iters // 20
    _check(args.lr_warmup_iters >= 0 and args.lr_warmup_iters < args.lr_decay_iters,
           "--lr-warmup-iters must be in [0, --lr-decay-iters)")
