"""Checkpoints through megatron-core ``dist_checkpointing``: reshardable, crash-safe, extensible.

Layout of ``--save DIR``::

    DIR/iter_0000100/                  one dist_checkpointing checkpoint (any rank layout)
    DIR/latest_checkpointed_iteration.txt

A save goes to ``DIR/.tmp_iter_N`` (one folder: every rank's must agree) and is renamed into
place only when every rank has finished, ``checksums.json`` is written and every rank sees
every file it lists; the ``latest`` pointer is replaced atomically last, so a crash mid-save
leaves the previous checkpoint and pointer untouched. With ``--save-retain N`` older
checkpoints are removed after that, keeping the newest N. Before a save
every rank's step counter, data position and extension states must agree (faults); before a
load the checksums are verified and no file may hold pickled code (checkpoint_integrity).

What is saved: model and optimizer (sharded tensors: load at another TP / PP layout works;
when loading, the optimizer's ``sharded_state_dict`` gets the checkpoint's common optimizer
state as ``metadata["saved_common"]``, so an optimizer whose saved sharding follows the saving
layout can ask for what was saved),
LR scheduler (a resume that would change it must say which schedule wins:
schedule_resume), iteration, consumed samples (the data position), the RNG states (restored only
at the same layout), and whatever later features :meth:`Checkpointer.register`.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

from megatron_ext.training.checkpoint_integrity import (check_one_folder, verify_checkpoint,
                                                       verify_saved, write_manifest)
from megatron_ext.errors import UsageError
from megatron_ext.training.faults import save_fingerprint, verify_ranks_agree
from megatron_ext.training.fsdp_checkpoint import (fsdp2_sharded_state, load_optimizer_state,
                                                   local_shards_as_dtensors,
                                                   matching_local_shards)
from megatron_ext.training.init import sharded_tensors
from megatron_ext.training.loop import TrainState
from megatron_ext.training.fused_optimizer import use_adam_kernel
from megatron_ext.training.optimizer import allocate_adam_state, restore_adam_step
from megatron_ext.training.schedule_resume import group_schedule, restore, saved_state

TRACKER = "latest_checkpointed_iteration.txt"
CONVERTED_SPEC = "megatron_model.json"
"""File name of the model spec ``convert_checkpoint.py hf-to-megatron`` writes beside the
checkpoint: its folder is a converted model, never resumed in place."""


class StateProvider(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def _layout() -> dict:
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size()}


def _rng_state() -> ShardedObject:
    state = {"cpu": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    pp, tp = (parallel_state.get_pipeline_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_rank())
    layout = _layout()
    return ShardedObject("rng_state", state, (layout["pp"], layout["tp"]), (pp, tp),
                         replica_id=parallel_state.get_data_parallel_rank())


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def locate_checkpoint(path: str) -> str:
    """The iteration directory ``--load PATH`` names: PATH itself, or the one its latest
    pointer names. ``UsageError`` saying precisely what is wrong (not a folder, missing,
    corrupt or dangling pointer, no checkpoint). Reads no checkpoint file; not collective."""
    if os.path.isfile(path):
        raise UsageError(f"--load: '{path}' is a file; give a checkpoint folder (a save root "
                         f"with {TRACKER}, or one iter_* folder)")
    if not os.path.isdir(path):
        raise UsageError(f"--load: checkpoint directory '{path}' does not exist")
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
        if not text.isdigit():
            raise UsageError(f"--load: corrupt {tracker} (expected an iteration number)")
        target = os.path.join(path, f"iter_{int(text):07d}")
        if not os.path.isdir(target):
            raise UsageError(f"--load: {tracker} is dangling: it names iteration {int(text)}, "
                             f"but '{target}' does not exist")
        path = target
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise UsageError(f"--load: '{path}' is not a checkpoint (no {TRACKER} or metadata.json)")
    return path


def resume_in_place(load: str | None, finetune: bool) -> tuple[str | None, str | None]:
    """Where a resume writes by default, as Megatron-LM users expect of ``--save`` =
    ``--load``: ``--load ROOT`` (a save root: go on from its latest checkpoint) saves into ROOT
    and logs into the run folder above it (the one with ``args.json``: ``runs/<ts>``).
    ``(run_dir or None, save root or None)``; (None, None) for one ``iter_*`` folder (a branch
    from an older checkpoint), a converted model (``hf-to-megatron``'s folder: the run gets
    its own), ``--finetune`` or no ``--load``."""
    converted = bool(load) and os.path.isfile(os.path.join(load, CONVERTED_SPEC))
    if not load or finetune or converted or not os.path.isfile(os.path.join(load, TRACKER)):
        return None, None
    parent = os.path.dirname(os.path.abspath(load))
    return (parent if os.path.isfile(os.path.join(parent, "args.json")) else None), load


def resolve_checkpoint_dir(path: str, unverified: bool = False) -> str:
    """``--load`` accepts a save root (uses its latest pointer) or one iteration directory.
    The directory is verified before anything reads it: checksums (a checkpoint without them
    only with ``unverified``), and no pickled code (checkpoint_integrity). Collective when
    torch.distributed is initialized."""
    path = locate_checkpoint(path)
    verify_checkpoint(path, unverified)
    return path


class Checkpointer:
    """Saves and restores the full training state of one rank's model chunks."""

    def __init__(self, save_dir: str | None, model: list, optimizer, scheduler,
                 retain: int | None = None):
        self.save_dir = save_dir
        self.retain = retain  # --save-retain: keep the newest N checkpoints (None: all)
        self.model = model
        self.modules = unwrap_model(model)  # the GPTModels inside the DDP wrappers
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extra: dict[str, StateProvider] = {}

    def register(self, name: str, provider: StateProvider) -> None:
        """Checkpoint ``provider``'s (replicated, picklable) state under ``name``."""
        self.extra[name] = provider

    def _model_state(self) -> dict:
        return model_sharded_state(self.modules)

    def _sharded_state(self, is_loading: bool, with_rng: bool,
                       saved_optimizer: dict | None = None) -> dict:
        model_sd = self._model_state()
        # the distributed optimizer's state in megatron's bucket layout (Megatron-LM's default):
        # reloadable at another DP size, not another TP / PP (its fully_reshardable format
        # fails to load torch AdamW's step in megatron-core 0.16.1)
        metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
        if is_loading:  # an optimizer whose sharding follows the saved one reads it here
            metadata["saved_common"] = saved_optimizer or {}
        with matching_local_shards():  # FSDP2 (fsdp_checkpoint.py); a no-op for DDP
            optimizer_sd = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                             metadata=metadata)
        state = {"model": model_sd, "optimizer": optimizer_sd}
        if with_rng:
            state["rng_state"] = _rng_state()
        return state

    def save(self, train_state: TrainState) -> str:
        verify_ranks_agree(save_fingerprint(train_state, self.extra),
                           f"the checkpoint save of step {train_state.iteration}")
        state = self._sharded_state(is_loading=False, with_rng=True)
        state.update(iteration=train_state.iteration,
                     consumed_samples=train_state.consumed_samples,
                     scheduler=saved_state(self.scheduler), layout=_layout(),
                     extra={name: p.state_dict() for name, p in self.extra.items()})
        return atomic_save(state, self.save_dir, train_state.iteration, self.retain)

    def load(self, path: str, finetune: bool = False, unverified: bool = False,
             train_iters: int | None = None) -> TrainState:
        """Restore from ``path``. The RNG only if the rank layout is unchanged; only the model
        weights (and a fresh TrainState) with ``finetune`` or from a weights-only checkpoint;
        a checkpoint without checksums only with ``unverified``; ``UsageError`` if it is past
        ``train_iters`` (before its schedule is compared with the flags')."""
        path = resolve_checkpoint_dir(path, unverified)
        try:
            common = dist_checkpointing.load_common_state_dict(path)
            weights_only = finetune or common.get("weights_only", False)
            same_layout = common.get("layout") == _layout()
            if not weights_only:
                allocate_adam_state(self.optimizer)
            request = ({"model": self._model_state()} if weights_only
                       else self._sharded_state(True, same_layout, common.get("optimizer")))
            check_model_shapes(request["model"], path)  # another model: said first
            _check_not_past(common, weights_only, train_iters, path)
            loaded = dist_checkpointing.load(request, path)
        except UsageError:
            raise
        except (Exception, CheckpointException) as exc:  # corrupt or incompatible: one line
            raise UsageError(f"--load: cannot read checkpoint '{path}': "
                             f"{_first_line(exc)}") from exc
        for i, module in enumerate(self.modules):
            module.load_state_dict(local_shards_as_dtensors(module, loaded["model"][f"chunk{i}"]))
        if weights_only:
            return TrainState()
        flag_groups = group_schedule(self.optimizer)  # before the checkpoint's replace them
        load_optimizer_state(self.optimizer, loaded["optimizer"])
        restore_adam_step(self.optimizer)
        use_adam_kernel(self.optimizer)  # the loaded groups carry the saving run's flags
        # UsageError on a mismatch
        schedule = restore(self.scheduler, common["scheduler"], flag_groups)
        if dist.get_rank() == 0:
            print(schedule, flush=True)
        if same_layout:
            _restore_rng(loaded["rng_state"])
        for name, provider in self.extra.items():
            if name in common.get("extra", {}):
                provider.load_state_dict(common["extra"][name])
        return TrainState(common["iteration"], common["consumed_samples"])


def _check_not_past(common: dict, weights_only: bool, train_iters: int | None,
                    path: str) -> None:
    """A checkpoint already past ``--train-iters`` leaves nothing to train: say so."""
    done = common.get("iteration", 0)
    if not weights_only and train_iters is not None and done > train_iters:
        raise UsageError(f"--load: already at step {done} ('{path}'), past --train-iters "
                         f"{train_iters}: nothing to train (pass --train-iters > {done} to go "
                         "on)")


def _first_line(exc: BaseException) -> str:
    """The first line of what went wrong (inside torch's ``CheckpointException``, a
    ``BaseException`` wrapping each failed rank's exception), at most 200 characters."""
    failures = getattr(exc, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 200 else line[:200] + "..."


def check_model_shapes(model_sd: dict, path: str) -> None:
    """megatron loads some tensors (embeddings) with ``allow_shape_mismatch``: a checkpoint of
    another vocabulary or width would load truncated or zero-padded, silently. Refuse it."""
    saved = dist_checkpointing.load_tensors_metadata(path)
    for sh in sharded_tensors(model_sd):
        if sh.key in saved and tuple(saved[sh.key].global_shape) != tuple(sh.global_shape):
            raise UsageError(f"--load: '{sh.key}' has shape {tuple(saved[sh.key].global_shape)} "
                             f"in the checkpoint but {tuple(sh.global_shape)} in this model "
                             "(check --vocab-size and the model flags)")


def model_sharded_state(modules) -> dict:
    """The model part of a checkpoint: each chunk's megatron sharded state dict (global keys,
    so any TP / PP / virtual-PP / FSDP2 layout can read it; FSDP2: fsdp_checkpoint.py)."""
    return {f"chunk{i}": fsdp2_sharded_state(m, m.sharded_state_dict())
            for i, m in enumerate(modules)}


def save_weights_only(modules, save_dir: str, iteration: int = 0, **metadata) -> str:
    """A model-only checkpoint (e.g. converted from Hugging Face) that ``--load`` reads as
    ``--finetune``: weights restored, optimizer and progress started fresh."""
    state = {"model": model_sharded_state(modules), "weights_only": True,
             "layout": _layout(), **metadata}
    return atomic_save(state, save_dir, iteration)


def atomic_save(state: dict, save_dir: str, iteration: int, retain: int | None = None) -> str:
    """dist_checkpointing.save into ``.tmp_iter_N``, rename to ``iter_N`` once every rank is
    done, then replace the ``latest`` pointer atomically, then (with ``retain``) remove all
    but the newest ``retain`` checkpoints. Collective: all ranks call it."""
    final = os.path.join(save_dir, f"iter_{iteration:07d}")
    tmp = os.path.join(save_dir, f".tmp_iter_{iteration:07d}")
    rank0 = dist.get_rank() == 0
    check_one_folder(save_dir)
    with _failed_save_removed(tmp, rank0, iteration):
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        dist_checkpointing.save(state, tmp)
        dist.barrier()
        write_manifest(tmp)  # sha256 of every file, verified on load
        verify_saved(tmp)  # every rank sees every listed file before "saved"
    if rank0:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        pointer = os.path.join(save_dir, TRACKER)
        with open(pointer + ".tmp", "w", encoding="utf-8") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer + ".tmp", pointer)
        print(f"saved checkpoint {final}", flush=True)
        if retain:
            prune_checkpoints(save_dir, iteration, retain)
    dist.barrier()
    return final


DISK_FULL_BYTES = 1 << 20
"""Less free space than this where a save failed means the disk filled up: torch's zip writer
reports a full disk as ``unexpected pos`` (no errno), so the free space is the evidence."""


def _no_space(exc: BaseException, path: str) -> bool:
    """Whether ``exc`` (or what it wraps: a cause, a failed writer, a rank's failure inside
    torch's ``CheckpointException``) is a full disk, or ``path``'s file system is full now."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC
                or os.strerror(errno.ENOSPC) in str(e)):  # a writer's error, pickled as text
            return True
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():
            todo += [f for f in (failure if isinstance(failure, tuple) else (failure,))
                     if isinstance(f, BaseException)]
    try:
        return shutil.disk_usage(path).free < DISK_FULL_BYTES
    except OSError:
        return False


@contextmanager
def _failed_save_removed(tmp: str, rank0: bool, iteration: int):
    """A save that fails (disk full, I/O error) leaves no temporary folder and says so in one
    line naming the folder (``UsageError``); the previous checkpoint and pointer are intact."""
    try:
        yield
    except (Exception, CheckpointException) as exc:
        full = _no_space(exc, os.path.dirname(os.path.abspath(tmp)))
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        reason = "no space left on device" if full else _first_line(exc)
        save_dir = os.path.dirname(tmp) or "."
        kept = latest_saved(save_dir)
        kept = f"checkpoint {kept} is intact" if kept else "no earlier checkpoint"
        raise UsageError(f"cannot save the checkpoint of step {iteration} to '{save_dir}': "
                         f"{reason} (its temporary folder was removed; {kept})") from exc


def latest_saved(save_dir: str) -> int | None:
    """The iteration ``save_dir``'s latest pointer names, or None (none, or unreadable)."""
    try:
        with open(os.path.join(save_dir, TRACKER), encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def prune_checkpoints(save_dir: str, newest: int, retain: int) -> list[int]:
    """Keep checkpoint ``newest`` (the one just saved) and the ``retain - 1`` highest other
    iterations; remove the rest, each renamed away first so that a crash mid-delete leaves no
    half checkpoint under a checkpoint's name. Returns the removed iterations."""
    found = [int(m.group(1)) for name in os.listdir(save_dir)
             if (m := re.fullmatch(r"iter_(\d{7})", name))]
    others = sorted((i for i in found if i != newest), reverse=True)
    doomed = others[retain - 1:]
    for i in doomed:
        os.rename(os.path.join(save_dir, f"iter_{i:07d}"),
                  os.path.join(save_dir, f".deleting_iter_{i:07d}"))
    for name in os.listdir(save_dir):  # these, and any a crash left behind
        if name.startswith(".deleting_iter_"):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    return doomed
