"""The training loop: megatron-core's pipeline schedules drive forward/backward, the megatron
optimizer steps, and every rank agrees on the logged loss."""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ext.data.sampler import MicroBatchIterator
from megatron_ext.training.distributed import device
from megatron_ext import extension as ext
from megatron_ext.training.faults import guarded_step
from megatron_ext.training.memory import PeakMemory


@dataclass
class TrainState:
    """Progress that a checkpoint must restore for an identical continuation."""

    iteration: int = 0
    """Optimizer steps taken."""
    consumed_samples: int = 0
    """Global training samples consumed (the data iterator's position)."""


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean next-token cross entropy over the unmasked tokens of one micro-batch."""
    mask = loss_mask.reshape(-1).float()
    loss = (output_tensor.float().reshape(-1) * mask).sum() / mask.sum().clamp(min=1)
    # clone: the schedule divides the returned loss in place by the micro-batch count
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    batch = {k: v.to(device(), non_blocking=True) if torch.is_tensor(v) else v
             for k, v in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def data_iterators(args, dataset, consumed_samples: int, num_chunks: int):
    """One iterator per model chunk (the interleaved schedule pulls from each separately)."""
    its = [MicroBatchIterator(dataset, args.micro_batch_size,
                              parallel_state.get_data_parallel_rank(),
                              parallel_state.get_data_parallel_world_size(), consumed_samples)
           for _ in range(num_chunks)]
    return its if num_chunks > 1 else its[0]


def run_schedule(args, model: list, data_iterator, forward_only: bool) -> float:
    """Forward (+backward) of one global batch; returns the mean loss, identical on all ranks."""
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=model if len(model) > 1 else model[0],
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=forward_only,
    )
    total = torch.zeros(1, dtype=torch.float64, device=device())
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        total += torch.stack([d["lm loss"].double() for d in losses]).mean()
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        total /= parallel_state.get_data_parallel_world_size()
    dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total.item()


def train_step(args, model, optimizer, scheduler, data_iterator) -> dict:
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss = run_schedule(args, model, data_iterator, forward_only=False)
    update_ok, grad_norm = guarded_step(optimizer, model, loss)  # skipped if non-finite
    if update_ok:
        scheduler.step(increment=1)
    return {"loss": loss, "grad_norm": grad_norm, "skipped": not update_ok}


@torch.no_grad()
def evaluate(args, model, valid_dataset) -> float:
    """Mean loss over the first ``--eval-iters`` global batches of the validation split."""
    for chunk in model:
        chunk.eval()
    iterator = data_iterators(args, valid_dataset, 0, len(model))
    loss = sum(run_schedule(args, model, iterator, forward_only=True)
               for _ in range(args.eval_iters)) / args.eval_iters
    for chunk in model:
        chunk.train()
    return loss


def _validate(args, model, valid_ds, state: TrainState, logger) -> None:
    if not args.eval_iters:
        return
    val_loss = evaluate(args, model, valid_ds)
    if logger:
        logger.validation({"step": state.iteration, "val_loss": val_loss,
                           "val_ppl": math.exp(min(val_loss, 50.0))})


def replay(args, model: list, train_dataset, consumed_samples: int, dataset=None) -> float:
    """Forward + backward of the global batch at ``consumed_samples`` of ``dataset`` (default:
    the training set) with no update; the gradient buffers are zeroed after. Returns its loss
    (``TrainingRun.replay``)."""
    dataset = train_dataset if dataset is None else dataset
    iterator = data_iterators(args, dataset, consumed_samples, len(model))
    loss = run_schedule(args, model, iterator, forward_only=False)
    for chunk in model:
        chunk.zero_grad_buffer()
    return loss


def _after_step(args, run, state, extensions) -> dict:
    """The extensions' hooks after a step: ``on_nonfinite`` (if it was skipped), then
    ``on_step``; returns their metrics."""
    extra = {}
    if run.step_result["skipped"]:
        for hook in ext.hooks(extensions, "on_nonfinite"):
            extra.update(hook(args, run, state) or {})
    for hook in ext.hooks(extensions, "on_step"):
        extra.update(hook(args, run, state) or {})
    return extra


def _should_stop(args, run, state, extensions) -> bool:
    """Asks every extension (its answer may be collective: never short-circuited)."""
    return any([stop(args, run, state) for stop in ext.hooks(extensions, "should_stop")])


def train(args: argparse.Namespace, run, logger, extensions=()) -> TrainState:
    """Train ``run`` (a TrainingRun) to ``--train-iters``: validate, log and checkpoint on
    schedule, and call the extensions' hooks (``megatron_ext.extension``) around every step."""
    model, optimizer, scheduler, state = run.model, run.optimizer, run.scheduler, run.state
    checkpointer = run.checkpointer if args.save else None
    train_ds, valid_ds = run.datasets
    iterator = data_iterators(args, train_ds, state.consumed_samples, len(model))
    tokens_per_step = args.global_batch_size * args.seq_length
    for chunk in model:
        chunk.train()
    if state.iteration == 0:
        _validate(args, model, valid_ds, state, logger)  # the starting point of the curve
    if logger and state.iteration >= args.train_iters:  # a resume of a finished run
        print(f"already at step {state.iteration} of --train-iters {args.train_iters}: "
              "nothing to train (pass a larger --train-iters to go on)", flush=True)
    for hook in ext.hooks(extensions, "on_train_start"):
        hook(args, run, state)
    memory = PeakMemory()  # peak since the last logged step, hooks included
    unlogged: dict = {}  # the hooks' metrics since the last logged step
    try:
        while state.iteration < args.train_iters:
            for phase in ("before_step", "commit_step"):  # propose, then commit (extension.py)
                for hook in ext.hooks(extensions, phase):
                    hook(args, run, state)
            lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
            start = time.time()
            run.step_result = train_step(args, model, optimizer, scheduler, iterator)
            step_time = time.time() - start
            state.iteration += 1
            state.consumed_samples += args.global_batch_size
            result = run.step_result
            last = state.iteration == args.train_iters  # always logged, whatever the interval
            stop = _due(args.exit_interval, state)
            result["logged"] = (state.iteration % args.log_interval == 0 or state.iteration == 1
                                or result["skipped"] or last or stop)
            extra = {**unlogged, **_after_step(args, run, state, extensions)}
            unlogged = {} if result["logged"] else extra  # events reach the next record
            if logger and result["logged"]:
                logger.train_step({
                    "step": state.iteration, "loss": result["loss"],
                    "lr": lr, "grad_norm": result["grad_norm"],
                    "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                    "consumed_samples": state.consumed_samples, **memory.metrics(), **extra})
            if state.iteration % args.eval_interval == 0 or last:
                _validate(args, model, valid_ds, state, logger)
            stop = _should_stop(args, run, state, extensions) or stop  # SIGTERM, too many skips
            if checkpointer is not None and (last or stop or _due(args.save_interval, state)):
                checkpointer.save(state)
            if stop:
                _say_exit_interval(args, state, logger, last)
                break
    finally:
        _end_hooks(args, run, state, extensions)
    return state


def _end_hooks(args, run, state, extensions) -> None:
    """Every extension's ``on_train_end``, even after an earlier one raised (the first
    exception is raised once all have run)."""
    first = None
    for hook in ext.hooks(extensions, "on_train_end"):
        try:
            hook(args, run, state)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            first = first or exc
    if first is not None:
        raise first


def _say_exit_interval(args, state: TrainState, logger, last: bool) -> None:
    """One line when ``--exit-interval`` ends the run before ``--train-iters``."""
    if logger and not last and _due(args.exit_interval, state):
        print(f"stopping at step {state.iteration} of --train-iters {args.train_iters}: "
              f"--exit-interval {args.exit_interval}"
              f"{', checkpoint saved' if args.save else ' (--no-save: nothing saved)'}",
              flush=True)


def _due(interval: int | None, state: TrainState) -> bool:
    return bool(interval) and state.iteration % interval == 0
