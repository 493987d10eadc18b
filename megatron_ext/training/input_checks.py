"""Inputs that parse but cannot work, refused in one line before anything is allocated.

Each check names the flag: a RoPE base or norm epsilon that makes every step NaN, an output
flag that is empty or contradicts ``--no-save``, and sizes that no machine here can hold -- a
sequence length whose activations (the dry run's memory model, :mod:`.dry_run.estimates`) or a
step count whose dataset index (megatron-core keeps 24 bytes per sample) exceed the
memory this process can have.
"""

from __future__ import annotations

import argparse
import os

from megatron_ext.errors import UsageError

INDEX_BYTES_PER_SAMPLE = 24
"""What megatron-core's GPT dataset index keeps per sample once the counts outgrow int32: a
shuffle-index entry and a sample-index pair, each int64."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise UsageError(message)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def machine_memory_bytes() -> int:
    """What one rank may hold: its GPU's memory, else this host's RAM over the ranks on it."""
    import torch

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        return torch.cuda.get_device_properties(local).total_memory
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def _outputs(args: argparse.Namespace) -> None:
    for flag in ("run_dir", "save", "load", "data_cache_path", "tensorboard_dir"):
        _check(getattr(args, flag) != "", f"--{flag.replace('_', '-')} '': give a folder")
    _check(not (args.no_save and args.save), f"--no-save and --save {args.save} exclude each "
                                             "other: drop one")


def _numerics(args: argparse.Namespace) -> None:
    _check(args.rotary_base > 0, f"--rotary-base {args.rotary_base:g} must be positive (RoPE's "
                                 "theta, e.g. 10000): every step would be NaN")
    _check(args.norm_epsilon > 0, f"--norm-epsilon {args.norm_epsilon:g} must be positive "
                                  "(e.g. 1e-5): every step would be NaN")
    _check(args.init_method_std > 0, f"--init-method-std {args.init_method_std:g} must be "
                                     "positive (e.g. 0.02)")
    _check(args.make_vocab_size_divisible_by > 0, "--make-vocab-size-divisible-by "
                                                  f"{args.make_vocab_size_divisible_by} must be "
                                                  "positive (1: no padding)")


def step_memory_lower_bound(args: argparse.Namespace) -> float:
    """Bytes one rank of the first pipeline stage needs at least: a lower bound on its
    weights, gradients and Adam state (attention and MLP matrices only) and its activations
    (flash attention, no logits), from the dry run's memory model."""
    from megatron_ext.training.dry_run.estimates import (Layout, activation_bytes,
                                                         model_state_bytes)

    layout = Layout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                    args.data_parallel, args.virtual_pipeline_model_parallel_size or 1,
                    args.num_microbatches, args.micro_batch_size, args.seq_length,
                    bool(args.sequence_parallel), bool(args.bf16),
                    bool(args.use_distributed_optimizer),
                    bool(args.use_torch_fsdp2 or args.use_megatron_fsdp),
                    flash_attention=True)
    h, layers = args.hidden_size, args.num_layers // layout.pp
    params = layers * (2 * h * h + 2 * h * args.ffn_hidden_size) / layout.tp
    return sum(model_state_bytes(int(params), layout)) + activation_bytes(
        0, layers, h, args.num_attention_heads, 0, layout)


def _sizes(args: argparse.Namespace, memory: int) -> None:
    need = step_memory_lower_bound(args)
    _check(need <= memory, f"--seq-length {args.seq_length}, --micro-batch-size "
                           f"{args.micro_batch_size}, --hidden-size {args.hidden_size}, "
                           f"--num-layers {args.num_layers}: one rank needs at least "
                           f"{_gib(need)} (the dry run's memory model), more than the "
                           f"{_gib(memory)} it can have here")
    samples = args.train_iters * args.global_batch_size
    index = samples * INDEX_BYTES_PER_SAMPLE
    _check(index <= memory, f"--train-iters {args.train_iters} x --global-batch-size "
                            f"{args.global_batch_size} = {samples:,} samples: their dataset "
                            f"index alone needs {_gib(index)}, more than the {_gib(memory)} "
                            "this process can have")


def check_inputs(args: argparse.Namespace) -> None:
    """``UsageError`` (one line naming the flag) for output flags and numerics that cannot
    work (the module docstring); every parse of the trainer's flags calls it."""
    _outputs(args)
    _numerics(args)


def check_sizes(args: argparse.Namespace, memory: int | None = None) -> None:
    """``UsageError`` if a training run of ``args`` cannot fit this machine; ``memory``: bytes
    one rank may hold (default: :func:`machine_memory_bytes`). Called by the trainer before
    anything is allocated (not by the dry run, which reports sizes, nor by the converter,
    which trains nothing); needs the layout checks' ``args.data_parallel`` and
    ``args.num_microbatches``."""
    _sizes(args, machine_memory_bytes() if memory is None else memory)
