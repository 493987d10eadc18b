"""DDP wrapping (FSDP: ``fsdp.py``), the megatron-core optimizer (AdamW, optionally
distributed) and LR schedule, and how to find the parameters a megatron optimizer updates
(:func:`main_params`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Iterator

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig

from megatron_ext.training.fused_optimizer import (
    step_tensor,
    torch_adams,
    use_adam_kernel,
    use_foreach_grad_norm,
)


def wrap_ddp(args: argparse.Namespace, config: TransformerConfig, chunks) -> list:
    """megatron-core DistributedDataParallel around each chunk (grads reduced in FP32), or
    with --use-torch-fsdp2 / --use-megatron-fsdp megatron-core's FSDP wrappers (fsdp.py)."""
    if args.use_torch_fsdp2 or args.use_megatron_fsdp:
        from megatron_ext.training.fsdp import wrap_fsdp

        config.finalize_model_grads_func = finalize_model_grads
        return wrap_fsdp(args, config, chunks)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                       disable_bucketing=i > 0)
               for i, chunk in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(args: argparse.Namespace, model: list):
    """megatron-core's optimizer (AdamW, megatron's clip) with torch's fused AdamW on CUDA,
    its foreach AdamW elsewhere, and a foreach gradient norm (``fused_optimizer.py``)."""
    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=bool(args.bf16),
        params_dtype=model[0].config.params_dtype,
        # FSDP2's shards go to the ordinary optimizer; Megatron-FSDP needs the distributed one
        use_distributed_optimizer=args.use_distributed_optimizer or args.use_megatron_fsdp,
    )
    use_foreach_grad_norm()
    optimizer = get_megatron_optimizer(config, model)
    use_adam_kernel(optimizer)
    return optimizer


def build_scheduler(args: argparse.Namespace, optimizer) -> OptimizerParamScheduler:
    """Iteration-based warmup + decay (constant / linear / cosine / WSD)."""
    wsd_steps = args.lr_wsd_decay_iters
    if args.lr_decay_style == "WSD" and wsd_steps is None:
        wsd_steps = max(1, args.lr_decay_iters // 5)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.lr_decay_iters,  # unused (constant); not --train-iters, which a
        wd_incr_style="constant",           # resume may change without changing the schedule
        wsd_decay_steps=wsd_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        # on --load: which schedule wins (training/schedule_resume.py)
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


@dataclass(frozen=True)
class MainParam:
    """One parameter a megatron optimizer updates on this rank."""

    sub: object
    """The megatron optimizer holding it (one of a ``ChainedOptimizer``'s); its ``optimizer``
    attribute is the inner torch optimizer whose ``state`` is keyed by ``main``."""
    model: torch.Tensor
    """The model's parameter."""
    main: torch.Tensor
    """What the inner optimizer updates: the parameter itself (FP32), its FP32 copy (BF16
    params), or with the distributed optimizer this rank's flat slice of either."""
    start: int
    """Offset of ``main``'s first element in the flattened ``model`` parameter."""
    distributed: bool
    """Whether ``main`` is a distributed-optimizer shard (other DP ranks hold the rest)."""


def main_params(optimizer) -> Iterator[MainParam]:
    """Every parameter with optimizer state on this rank, for the three megatron optimizers
    (FP32, Float16 with FP32 main copies, distributed), chained or not."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(sub, "optimizer", None) is None:  # a stub: no parameters on this rank
            continue
        if hasattr(sub, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
            pairs = [(sub.model_float16_groups, sub.shard_fp32_from_float16_groups),
                     (sub.model_fp32_groups, sub.shard_fp32_groups)]
        elif hasattr(sub, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            pairs = [(sub.float16_groups, sub.fp32_from_float16_groups),
                     (sub.fp32_from_fp32_groups, sub.fp32_from_fp32_groups)]
        else:  # FP32Optimizer: the model params are the main params
            groups = [g["params"] for g in sub.optimizer.param_groups]
            pairs = [(groups, groups)]
        distributed = hasattr(sub, "shard_fp32_from_float16_groups")
        for model_groups, main_groups in pairs:
            for model_group, main_group in zip(model_groups, main_groups):
                for model, main in zip(model_group, main_group):
                    start = (sub._get_model_param_range_map(model)["param"].start
                             if distributed else 0)
                    yield MainParam(sub, model, main, start, distributed)


def adam_moments(inner, main: torch.Tensor) -> dict | None:
    """AdamW's state of ``main`` in the inner torch optimizer ``inner``: ``exp_avg``,
    ``exp_avg_sq`` (float, shaped like ``main``) and ``step``; None before the first step.
    An inner optimizer that stores its moments in another form (STQuant's quantized AdamW)
    answers through its ``dequantized_state(main)``."""
    reader = getattr(inner, "dequantized_state", None)
    return reader(main) if reader is not None else inner.state.get(main)



def _torch_adams_in_distributed_optimizers(optimizer):
    """The inner torch Adam / AdamW of each megatron ``DistributedOptimizer`` in ``optimizer``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer):
            yield from torch_adams(opt)


def allocate_adam_state(optimizer) -> None:
    """Before a load: give every parameter of a fresh ``DistributedOptimizer``'s inner torch
    Adam a zero state (step 0, zero moments), as its first step would. megatron's
    ``sharded_state_dict`` reads the step from that state (TE's and apex's fused Adam keep it in
    the parameter groups; torch allocates it only at the first step). The load overwrites the
    moments; :func:`restore_adam_step` the step."""
    for inner in _torch_adams_in_distributed_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {"step": step_tensor(group, param, 0),
                                          "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}


def restore_adam_step(optimizer) -> None:
    """After a load: megatron's bucket-space format (``dp_reshardable``) writes each
    parameter's state tensors back, but the 0-d step not; the checkpoint's step is in the
    loaded parameter groups — put it into every parameter's state, as megatron's own
    ``load_state_dict`` does for torch Adam."""
    for inner in _torch_adams_in_distributed_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" in group:
                for param in group["params"]:
                    inner.state[param]["step"] = step_tensor(group, param, group["step"])
