"""``pretrain(family)``: parse, build (model, optimizer, data, checkpoints), train.

The entry points ``pretrain_llama.py`` / ``pretrain_gpt.py`` only call :func:`main`.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from megatron_ext.training import dry_run
from megatron_ext import extension as ext
from megatron_ext.training.arguments import build_parser, given_flags, parse_args
from megatron_ext.training.distributed import resolve_launch
from megatron_ext.training.layer_impl import (resolve_transformer_impl,
                                              transformer_engine_available)
from megatron_ext.training import child_processes
from megatron_ext.training.outputs import check_run_outputs
from megatron_ext.training.input_checks import check_sizes
from megatron_ext.training.peers import peer_loss_reported
from megatron_ext.training.run_dir import claim_run_dir, release
from megatron_ext.errors import UsageError


@dataclass
class TrainingRun:
    """Everything ``setup`` builds for one rank (what hooks get as ``run``)."""

    model: list
    """Model chunks wrapped in megatron DDP (one per virtual pipeline stage)."""
    optimizer: object
    """megatron-core optimizer (AdamW, distributed or not), or an extension's."""
    scheduler: object
    """megatron-core OptimizerParamScheduler."""
    datasets: tuple
    """(train, validation) datasets."""
    state: object
    """TrainState: iteration and consumed samples (restored on --load)."""
    checkpointer: object
    """Checkpointer; extensions register extra state on it."""
    replay: Callable[..., float]
    """``replay(consumed_samples, dataset=None)``: forward + backward of the global batch that
    starts at that sample (of the training set by default), through the real pipeline
    schedule, with no update and the gradients zeroed after; returns its loss (observed
    passes: ``megatron_ext.precision.observe``)."""
    step_result: dict = field(default_factory=dict)
    """The last step's ``loss``, ``grad_norm`` and ``skipped`` (empty before the first)."""


def _write_args(args) -> None:
    os.makedirs(args.run_dir, exist_ok=True)
    with open(os.path.join(args.run_dir, "args.json"), "w", encoding="utf-8") as f:
        json.dump(vars(args), f, indent=2, sort_keys=True, default=str)


def setup(args, extensions: list[ext.Extension] = ()) -> TrainingRun:
    """Distributed init, data, model (then the extensions' ``after_model``), optimizer,
    scheduler, checkpointer; the extensions' ``after_setup``; resumes on --load."""
    from megatron_ext.training import checkpointing, data, distributed, init, loop, model, optimizer
    from megatron_ext.training.attention_backend import resolve_attention_backend
    from megatron_ext.training.loop import TrainState

    distributed.initialize(args)
    claim_run_dir(args)  # rank 0's folder for every rank, locked (training/run_dir.py)
    tokenizer, train_ds, valid_ds = data.build_data(args)
    args.padded_vocab_size = model.padded_vocab_size(model.vocab_size(tokenizer, args), args)
    config = model.transformer_config(args)
    linears = ext.the_one(extensions, "linear_classes", args)
    args.transformer_impl = resolve_transformer_impl(args.transformer_impl, linears is not None,
                                                     transformer_engine_available(),
                                                     args.attention_backend)
    args.attention_backend = resolve_attention_backend(args.attention_backend,
                                                       args.transformer_impl)  # for args.json
    linears = linears or model.default_linear_classes
    chunks = model.build_model_chunks(args, config, args.padded_vocab_size, linears)
    init.initialize_layout_invariant(chunks, config, args.seed)
    if torch.cuda.is_available():
        chunks = [c.cuda() for c in chunks]
    for hook in ext.hooks(extensions, "after_model"):  # new parameters reach DDP, optimizer
        hook(args, chunks)
    ddp_model = optimizer.wrap_ddp(args, config, chunks)
    opt = (ext.the_one(extensions, "build_optimizer", args, ddp_model, optimizer.build_optimizer)
           or optimizer.build_optimizer(args, ddp_model))
    for wrap in ext.hooks(extensions, "wrap_optimizer"):
        opt = wrap(args, ddp_model, opt)
    scheduler = optimizer.build_scheduler(args, opt)
    ckpt = checkpointing.Checkpointer(args.save, ddp_model, opt, scheduler, args.save_retain)
    run = TrainingRun(ddp_model, opt, scheduler, (train_ds, valid_ds), TrainState(), ckpt,
                      partial(loop.replay, args, ddp_model, train_ds))
    for hook in ext.hooks(extensions, "after_setup"):
        hook(args, run, run.state)
    if args.load:
        run.state = ckpt.load(args.load, args.finetune, args.load_unverified, args.train_iters)
    return run


def _announce(family: str, args, run: TrainingRun, extensions: list[ext.Extension]) -> None:
    """The model line, then one line per feature the run uses (``Extension.describe``)."""
    n_params = sum(p.numel() for c in run.model for p in c.parameters())
    lines = [f"{family} '{args.model}': {n_params:,} parameters on rank 0 | TP="
             f"{args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
             f"DP={args.data_parallel} | {args.num_microbatches} "
             f"micro-batch{'es' if args.num_microbatches != 1 else ''}/step | "
             f"run dir {args.run_dir}"]
    lines += [line for describe in ext.hooks(extensions, "describe")
              if (line := describe(args)) is not None]
    print("\n".join(lines), flush=True)


def parse_and_validate(family: str, argv, extensions: list[ext.Extension]):
    """``(args, simulated launch or None)``: the flags parsed as pretrain parses them (with
    ``--dry-run``'s), checked by every extension's ``validate``; ``UsageError`` if bad."""
    provider = dry_run.args_provider(ext.args_provider(extensions))
    optimizers = ext.declared(extensions, "optimizers")
    once = ["--optimizer", *ext.flag_options(extensions)]  # the extensions' flags: the seams
    given = given_flags(build_parser(family, provider, optimizers), argv, once)
    simulated = dry_run.request(family, argv, provider, optimizers)
    args = parse_args(family, argv, provider, simulated and simulated.world_size, optimizers)
    ext.refuse_inactive_flags(extensions, args, given)  # --snip-budget without SNIP: one line
    ext.refuse_conflicts(extensions, args)  # --precision snip --use-megatron-fsdp: one line
    for validate in ext.hooks(extensions, "validate"):
        validate(args)
    return args, simulated


def pretrain(family: str, argv=None, extensions: list[ext.Extension] = ()):
    """Train a ``family`` ("llama" / "gpt") model; returns the final TrainState (with
    ``--dry-run``: the DryRunReport; with ``--check-flags``: None; nothing is started)."""
    from megatron_ext.training.loop import train
    from megatron_ext.training.metrics import MetricsLogger

    extensions = list(extensions)
    args, simulated = parse_and_validate(family, argv, extensions)
    if simulated:
        return dry_run.run(args, simulated, extensions)
    check_sizes(args)  # what this machine can hold, before anything is allocated
    check_run_outputs(args, resolve_launch().rank)  # before any work (training/outputs.py)
    if args.check_flags:
        print("flags ok", flush=True)
        return None
    child_processes.install(bool(args.save))  # checkpoint helpers die with this process
    run = setup(args, extensions)
    logger = None
    if dist.get_rank() == 0:
        _write_args(args)
        logger = MetricsLogger(args.run_dir, args.train_iters, args.tensorboard_dir,
                               run.state.iteration if args.load else None)
        _announce(family, args, run, extensions)
    try:
        return train(args, run, logger, extensions)
    finally:
        if logger:
            logger.close()
        release()  # the run folder's lock (run_dir.py): the next run in this process may go on


def main(family: str, extensions: list[ext.Extension] = ()) -> int:
    """CLI wrapper: bad input -> one line on stderr and exit status 2."""
    try:
        with peer_loss_reported():  # a dead or stalled rank: one line (training/peers.py)
            pretrain(family, extensions=extensions)
    except UsageError as exc:
        if resolve_launch().rank == 0 or getattr(exc, "every_rank", False):
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, the shell's status for SIGINT
        if resolve_launch().rank == 0:
            print(f"interrupted (Ctrl-C){f': {exc}' if str(exc) else ''}", file=sys.stderr,
                  flush=True)
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
