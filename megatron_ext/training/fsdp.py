"""Fully sharded data parallel through megatron-core's own wrappers.

``--use-torch-fsdp2`` wraps each model chunk in megatron-core's
``TorchFullyShardedDataParallel``: torch's ``fully_shard`` (FSDP2) on every transformer layer
and on the embedding, then on the whole chunk. Each parameter becomes a ``DTensor`` whose
local part is ``1/D`` of its rows (``D`` the data-parallel size); before a unit's forward and
backward its weights are all-gathered, after backward its gradients are reduce-scattered, so
each rank holds, between steps, ``1/D`` of the weights, the gradients and — because the
optimizer only ever sees the shards — the optimizer state. The optimizer is megatron-core's
ordinary (not distributed) one: it steps the shards it is given, and its gradient clipping
sums the shards' squared norms over the data-parallel group (``DTensor`` aware).

On CPU the same wrapper runs on gloo once ``megatron_ext.compat.cpu`` gives it a CPU device
mesh (patch point 6). ``--use-megatron-fsdp`` (Megatron-FSDP) has no CPU path: see
:func:`megatron_fsdp_blocker` and docs/parallelism.md.
"""

from __future__ import annotations

import argparse

import torch
from megatron.core.distributed.torch_fully_sharded_data_parallel import (
    TorchFullyShardedDataParallel,
)
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
    TorchFullyShardedDataParallelConfig,
)
from megatron.core.transformer import TransformerConfig

from megatron_ext.errors import UsageError
from megatron_ext.training.fsdp_checkpoint import fsdp2_sharded_state


class TorchFSDP2(TorchFullyShardedDataParallel):
    """megatron-core's FSDP2 wrapper with the grad-sync signature its own caller uses.

    megatron-core 0.16.1's ``finalize_model_grads`` calls
    ``finish_grad_sync(force_all_reduce=...)`` on every chunk, but the FSDP2 wrapper inherits
    ``_BaseDataParallel.finish_grad_sync(self)``, which takes no argument: the first step
    fails on any device. FSDP2 has already reduce-scattered the gradients in its
    post-backward hooks, so there is nothing left to do here."""

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Nothing to wait for: FSDP2 reduce-scatters inside backward."""


def megatron_fsdp_blocker() -> str | None:
    """Why ``--use-megatron-fsdp`` cannot run here (None on a CUDA machine); the full list of
    CUDA-only calls is in docs/parallelism.md."""
    if torch.cuda.is_available():
        return None
    return ("--use-megatron-fsdp needs CUDA: Megatron-FSDP builds torch.device('cuda:N'), "
            "orders its buffers with torch.cuda.Stream()s and reduces gradients with NCCL's "
            "PREMUL_SUM (and needs the einops package); --use-torch-fsdp2 runs on CPU")


def wrap_torch_fsdp2(config: TransformerConfig, chunks, transformer_impl: str) -> list:
    """Each chunk in megatron-core's FSDP2 wrapper (the module docstring).

    ``config.transformer_impl`` is what megatron-core reads to choose the sharding units:
    with Transformer Engine layers it also shards every ``ColumnParallelLinear`` (the output
    layer); with local layers those linears sit *inside* the transformer layers, which are
    sharded first, so sharding them again would meet parameters that are already ``DTensor``s.
    The field's default is ``transformer_engine``, so it is set to the layers actually built."""
    config.transformer_impl = transformer_impl
    ddp_config = TorchFullyShardedDataParallelConfig(reshard_after_forward=True)
    return [TorchFSDP2(config, ddp_config, chunk) for chunk in chunks]


def wrap_megatron_fsdp(config: TransformerConfig, chunks) -> list:
    """Each chunk in Megatron-FSDP (``optim_grads_params``): GPU only."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    blocker = megatron_fsdp_blocker()
    if blocker is not None:
        raise UsageError(blocker)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params")
    return [FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=chunk)
            for chunk in chunks]


def wrap_fsdp(args: argparse.Namespace, config: TransformerConfig, chunks) -> list:
    """``--use-torch-fsdp2`` or ``--use-megatron-fsdp`` around this rank's chunks."""
    if not args.use_torch_fsdp2:
        return wrap_megatron_fsdp(config, chunks)
    wrapped = wrap_torch_fsdp2(config, chunks, args.transformer_impl)
    if args.save or args.load:  # refuse a layout FSDP2 checkpoints cannot describe now, not
        for chunk in wrapped:   # at the first save
            fsdp2_sharded_state(chunk.module, chunk.module.sharded_state_dict())
    return wrapped

