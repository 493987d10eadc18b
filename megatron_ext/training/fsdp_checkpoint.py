"""dist_checkpointing of an FSDP2-sharded model: the same global tensors as a DDP checkpoint.

Under ``--use-torch-fsdp2`` each parameter is a ``DTensor``; rank ``d`` of the data-parallel
group (size ``D``) holds rows ``[d·R/D, (d+1)·R/D)`` of the ``R`` rows of its TP-local tensor.
megatron-core's sharded state dict describes that by adding the DP rank to the row offsets
(``make_tp_sharded_tensor_for_checkpoint``: fragment ``t·D + d`` of ``T·D`` for TP rank ``t``
of ``T``), which is right for every plain tensor. Three places in megatron-core 0.16.1 /
torch 2.13 need help, each fixed here and used by ``checkpointing.py``:

1. **SwiGLU's fc1.** The TP-local ``linear_fc1.weight`` is ``[gate_t; up_t]`` and megatron's
   ``apply_swiglu_sharded_factory`` splits the *local* tensor in two halves, labelling the
   first gate and the second up. Under FSDP2 the local tensor is one DP block, so that labels
   half of the gate rows "up": an FSDP2 checkpoint then loads scrambled into DDP (seen: the
   resumed loss jumped from 5.03 to 5.41). With ``D`` even, block ``d`` lies wholly in one
   half, so it is one plain shard of the global ``[gate; up]`` tensor (``2F`` rows, ``T·D``
   fragments of ``2F/(T·D)`` rows)::

       d <  D/2:  gate rows, fragment  t·D/2 + d
       d >= D/2:  up rows,   fragment  T·D/2 + t·D/2 + (d − D/2)

   :func:`fsdp2_sharded_state` replaces the factory by that shard (odd ``D`` is refused).
2. **Optimizer ↔ model matching.** megatron pairs optimizer parameters with the model's
   shards by ``id(to_local(param))``; torch 2.13's ``DTensor.to_local()`` returns a fresh view
   for an ``nn.Parameter`` (pytorch gh-166156), so nothing matched ("Param id 0 does not
   match any model sharded param"). :func:`matching_local_shards` makes megatron's lookup use
   the shard itself while the optimizer's sharded state dict is built.
3. **Loading.** dist_checkpointing returns each rank's local shards as plain tensors;
   ``load_state_dict`` and torch's Adam need them as ``DTensor``\\ s like their parameters
   (:func:`local_shards_as_dtensors`, :func:`load_optimizer_state`).

Uneven shards (a first dimension not divisible by ``D``) have no consistent global
description in megatron's scheme, so :func:`fsdp2_sharded_state` refuses them too.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing import optimizer as mcore_optimizer_ckpt
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from torch.distributed.tensor import DTensor

from megatron_ext.errors import UsageError

_SWIGLU_BUILDER = "apply_swiglu_sharded_factory.<locals>.sh_ten_build_fn"


def _dtensor_shards(module: torch.nn.Module) -> dict[int, tuple[str, DTensor]]:
    """id of each DTensor parameter's local shard -> (name, parameter)."""
    return {id(p._local_tensor): (name, p) for name, p in module.named_parameters()
            if isinstance(p, DTensor)}


def _check_even(name: str, param: DTensor, dp: int) -> None:
    if param.shape[0] % dp:
        raise UsageError(f"--use-torch-fsdp2: checkpoints need every parameter's first "
                         f"dimension divisible by the data-parallel size {dp}; '{name}' has "
                         f"{param.shape[0]} (choose another data-parallel size, or --no-save)")


def swiglu_block_fragment(t: int, tp: int, d: int, dp: int) -> int:
    """Which of the ``tp·dp`` equal row blocks of the global ``[gate; up]`` fc1 weight is
    FSDP2 block ``d`` (of ``dp``, even) of TP rank ``t``'s ``[gate_t; up_t]`` (module docstring)."""
    half = dp // 2
    return t * half + d if d < half else tp * half + t * half + (d - half)


def swiglu_fc1_shard(factory: ShardedTensorFactory, dp: int) -> ShardedTensor:
    """The plain shard of the global ``[gate; up]`` tensor this rank's FSDP2 block of a
    SwiGLU fc1 weight is (module docstring, item 1)."""
    if dp % 2:
        raise UsageError(f"--use-torch-fsdp2 with SwiGLU: checkpoints need an even "
                         f"data-parallel size (it is {dp}; or --no-save)")
    built = factory.build()  # megatron's two halves: their leading (layer) offsets are kept
    if built[0].key != factory.key:
        raise UsageError(f"--use-torch-fsdp2: no FSDP2 checkpoint layout for '{factory.key}' "
                         "saved as separate gate / up tensors")
    pre = built[0].prepend_axis_num
    prepend = [(axis, built[0].global_offset[axis], built[0].global_shape[axis])
               for axis in range(pre)]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    t = parallel_state.get_tensor_model_parallel_rank()
    d = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    fragment = swiglu_block_fragment(t, tp, d, dp)
    return ShardedTensor.from_rank_offsets(factory.key, factory.data, *prepend,
                                           (pre, fragment, tp * dp),
                                           replica_id=factory.replica_id, prepend_axis_num=pre)


def fsdp2_sharded_state(module: torch.nn.Module, state: dict) -> dict:
    """``module.sharded_state_dict()`` made right for FSDP2 shards (unchanged without them)."""
    shards = _dtensor_shards(module)
    if not shards:
        return state
    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    for name, param in shards.values():
        _check_even(name, param, dp)
    out = dict(state)
    for key, value in state.items():
        if not (isinstance(value, ShardedTensorFactory) and id(value.data) in shards) or dp == 1:
            continue
        if value.build_fn.__qualname__ != _SWIGLU_BUILDER:
            raise UsageError(f"--use-torch-fsdp2: no FSDP2 checkpoint layout for '{value.key}' "
                             f"({value.build_fn.__qualname__})")
        out[key] = swiglu_fc1_shard(value, dp)
    return out


def _local_shard(tensor):
    """The DTensor's own local tensor (not a fresh view of it)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


@contextlib.contextmanager
def matching_local_shards():
    """While active, megatron's optimizer checkpoint code matches parameters to model shards
    by the shard object itself (module docstring, item 2)."""
    original = mcore_optimizer_ckpt.to_local_if_dtensor
    mcore_optimizer_ckpt.to_local_if_dtensor = _local_shard
    try:
        yield
    finally:
        mcore_optimizer_ckpt.to_local_if_dtensor = original


def _like(value: torch.Tensor, param: DTensor) -> DTensor:
    return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride())


def local_shards_as_dtensors(module: torch.nn.Module, state: dict) -> dict:
    """``state`` (loaded local shards) with each plain tensor whose entry in ``module``'s state
    dict is a ``DTensor`` wrapped back into one, so ``load_state_dict`` accepts it."""
    targets = module.state_dict(keep_vars=True)
    out = dict(state)
    for key, value in state.items():
        target = targets.get(key)
        if (isinstance(target, DTensor) and torch.is_tensor(value)
                and not isinstance(value, DTensor)):
            out[key] = _like(value, target)
    return out


def _inner_optimizers(optimizer, state) -> list:
    """(megatron optimizer, its part of ``state``) pairs, as ChainedOptimizer splits them."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return list(zip(inner, [state] if len(inner) == 1 else state))


def load_optimizer_state(optimizer, state) -> None:
    """``optimizer.load_state_dict(state)`` where parameters may be ``DTensor``\\ s: the FP32
    main parameters (BF16 runs) are wrapped before megatron copies them in, and each Adam state
    tensor that is a parameter's local shard after torch's Adam took it (it refuses the mix).
    Under ``no_grad``: megatron's distributed optimizer copies FP32 main parameters in place,
    and in an FP32 run they are views of the model's (grad-requiring) parameters."""
    pairs = _inner_optimizers(optimizer, state)
    for inner, part in pairs:
        saved = part.get("fp32_from_fp16_params") if isinstance(part, dict) else None
        for current_group, saved_group in zip(getattr(inner, "fp32_from_float16_groups", []),
                                              saved or []):
            for i, (current, value) in enumerate(zip(current_group, saved_group)):
                if isinstance(current, DTensor) and not isinstance(value, DTensor):
                    saved_group[i] = _like(value, current)
    with torch.no_grad():
        optimizer.load_state_dict(state)
    for inner, _ in pairs:
        for param, param_state in inner.optimizer.state.items():
            if not isinstance(param, DTensor):
                continue
            for key, value in param_state.items():
                if (torch.is_tensor(value) and not isinstance(value, DTensor)
                        and value.shape == param._local_tensor.shape):
                    param_state[key] = _like(value, param)
