"""DDP wrapping (FSDP: ``fsdp.py``), the megatron-core optimizer (AdamW, optionally
distributed) and LR schedule."""

from __future__ import annotations

import argparse

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig


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
    return get_megatron_optimizer(config, model)


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
