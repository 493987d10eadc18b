"""Build every pipeline stage's real megatron-core model on the meta device, in one process.

megatron-core's layers size their shards from process groups (``tp_group.size()``,
``pp_group.rank()``), so building stage ``k`` of a TP=4 x PP=8 x DP=2 job needs groups that
*say* they have those sizes and that rank, but no other processes. torch's **fake process
group** (``torch.testing._internal.distributed.fake_pg``: "a process group which doesn't
actually do any communication ... You can run a single rank with a fake process group without
needing multiple processes (simulates per-rank behavior)") provides exactly that; megatron's
``initialize_model_parallel`` then builds its TP / PP / DP groups on it as usual (without its
extra gloo groups, which need a real store).

For each stage the fake world is brought up with the global rank of that stage's first GPU
(``DP = 0``, ``TP = 0``), and ``build_model_chunks`` (the same function a real run calls) builds
the stage under ``torch.device("meta")``: shapes and dtypes, no storage, so a 70B model costs
no memory. ``use_cpu_initialization`` keeps megatron from asking for CUDA storage explicitly
(which would bypass the meta device); initialisation itself runs on meta tensors (a no-op) but
is kept on because it is what tags the TP-sharded parameters (``tensor_model_parallel``).

Counting: a GPU holds ``Σ numel`` of its chunks' parameters. A stage's distinct parameters are
``Σ numel · t`` over TP-sharded parameters plus ``Σ numel`` over replicated ones (norms,
biases of row-parallel layers); the model's total skips the copy of tied word embeddings that
the last stage holds (megatron tags that copy ``shared``).

The layers are always megatron-core's local ones: Transformer Engine's fused norm + linear
modules hold the same parameters, and need TE and a GPU to build; a TE attention backend
(``flash``, ``fused``, ``unfused``) is stood in for by SDPA, which has no parameters either
(:func:`local_stand_in`). What the GPU job runs — its layers, attention, FP8 GEMMs — the
report takes from the real run's own decisions, not from these stand-ins.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ext.compat import cpu
from megatron_ext.errors import UsageError
from megatron_ext.training.attention_backend import LOCAL_BACKENDS


@dataclass(frozen=True)
class StageParams:
    """Parameter counts of one pipeline stage, from its megatron modules."""

    stage: int
    """Pipeline stage index."""
    layers: tuple[int, ...]
    """Global indices of the transformer layers this stage holds (all its virtual chunks)."""
    per_gpu: int
    """Parameters one GPU of the stage holds (its TP shard)."""
    distinct: int
    """Distinct parameters of the stage (TP shards counted once, replicas once)."""
    shared: int
    """Of ``distinct``, parameters that are a copy of another stage's (tied output layer)."""
    pre_process: bool
    """Holds the input embedding."""
    post_process: bool
    """Holds the final norm and output layer."""


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, args):
    """A one-process fake ``world_size`` job at ``rank`` with megatron's parallel groups."""
    from megatron.core import parallel_state
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank<r>]" to tracebacks
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            create_gloo_process_groups=False)
        yield parallel_state
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        sys.excepthook = hook


def stage_first_ranks(args) -> list[int]:
    """Global rank of each stage's first GPU (megatron's rank order, DP = TP = 0)."""
    with fake_world(args.world_size, 0, args) as ps:
        return dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())


def _count(chunks, tp: int) -> tuple[int, int, int, list[int]]:
    """(per GPU, distinct, shared, global layer numbers) of a stage's chunks."""
    per_gpu = distinct = shared = 0
    for param in (p for c in chunks for p in c.parameters()):
        n = param.numel() * (tp if getattr(param, "tensor_model_parallel", False) else 1)
        per_gpu += param.numel()
        distinct += n
        shared += n if getattr(param, "shared", False) else 0
    layers = [layer.layer_number - 1 for c in chunks for layer in c.decoder.layers]
    return per_gpu, distinct, shared, layers


def _stage_config(args):
    from megatron_ext.training import model

    config = model.transformer_config(args)
    config.use_cpu_initialization = True  # explicit CUDA storage would bypass the meta device
    config.perform_initialization = True  # tags TP-sharded params; free on meta tensors
    return config


def local_stand_in(args) -> argparse.Namespace:
    """The flags with megatron-core's local layers and a local attention backend (a TE
    backend's stand-in: SDPA), which build on the meta device with the job's parameters."""
    backend = args.attention_backend if args.attention_backend in LOCAL_BACKENDS else "sdpa"
    return argparse.Namespace(**{**vars(args), "transformer_impl": "local",
                                 "attention_backend": backend})


def build_stage(args, stage: int, rank: int, vocab: int) -> StageParams:
    """Build ``stage`` on the meta device in a fake world at ``rank``; count its parameters."""
    from megatron_ext.training import model

    local = local_stand_in(args)
    with fake_world(args.world_size, rank, args) as ps:
        assert ps.get_pipeline_model_parallel_rank() == stage
        with torch.device("meta"):
            chunks = model.build_model_chunks(local, _stage_config(local), vocab)
        per_gpu, distinct, shared, layers = _count(chunks, args.tensor_model_parallel_size)
        return StageParams(stage, tuple(layers), per_gpu, distinct, shared,
                           chunks[0].pre_process, chunks[-1].post_process)


def _build_or_refuse(args, stage: int, rank: int, vocab: int) -> StageParams:
    """``build_stage``, with megatron-core's own refusal of a layout as a ``UsageError``."""
    try:
        return build_stage(args, stage, rank, vocab)
    except (AssertionError, ValueError, RuntimeError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"megatron-core cannot build pipeline stage {stage} of this "
                         f"layout: {reason}") from None


def build_stages(args, vocab: int) -> list[StageParams]:
    """Every stage of the layout, one at a time, in this process."""
    if dist.is_initialized():
        raise UsageError("--dry-run simulates the whole job in one process: it needs a "
                         "process where torch.distributed is not initialised yet")
    was_active = cpu.is_active()
    cpu.activate()
    try:
        return [_build_or_refuse(args, k, rank, vocab)
                for k, rank in enumerate(stage_first_ranks(args))]
    finally:
        if not was_active:
            cpu.deactivate()
