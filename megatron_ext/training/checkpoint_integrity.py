"""Checkpoint integrity: a sha256 manifest per checkpoint, and no file that could run code.

Why:

* **Corruption** (a truncated copy, a bad disk, a flipped bit) should fail loudly at ``--load``
  and name the file, not surface as a shape error deep inside torch or, worse, load silently.
  Every save writes ``checksums.json`` (sha256 of every file of the checkpoint directory) into
  the temporary directory before it is renamed into place; every load verifies it first, and
  a checkpoint without one loads only with ``--load-unverified``.
  The hashing is split over the ranks (rank r hashes files r, r + world, ...), so a large
  checkpoint costs each rank only its share.
* **Untrusted files.** Unpickling runs whatever code a pickle names. megatron-core's
  ``dist_checkpointing`` reads ``common.pt`` with ``torch.load`` (``weights_only`` by default in
  torch >= 2.6, unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set), but torch's distributed
  checkpoint reader unpickles ``.metadata`` with plain ``pickle.load`` and the byte items inside
  ``*.distcp`` files (megatron's ``ShardedObject``: RNG states, layer extra state) with a
  ``torch.load`` that is explicitly not weights-only. :func:`check_no_code` reads all of these
  first, with ``torch.load(weights_only=True)`` or a restricted unpickler that accepts only the
  classes a torch distributed checkpoint's metadata consists of, and refuses the checkpoint
  (one line, naming the file) if any of them names anything else. A checksum is no defence against a
  crafted checkpoint (its maker rewrites the manifest too); this check is.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re

import torch
import torch.distributed as dist

from megatron_ext.errors import UsageError
from megatron_ext.training.distributed import gather_objects

MANIFEST = "checksums.json"
_CHUNK = 1 << 22


def _world() -> tuple[int, int]:
    """(rank, world size); one process when torch.distributed is not initialized."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_files(ckpt_dir: str) -> list[str]:
    """Every file under ``ckpt_dir`` (relative, '/'-separated, sorted), the manifest excepted."""
    found = []
    for root, _, names in os.walk(ckpt_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), ckpt_dir).replace(os.sep, "/")
            if rel != MANIFEST:
                found.append(rel)
    return sorted(found)


def write_manifest(ckpt_dir: str) -> None:
    """Hash every file of ``ckpt_dir`` (each rank its share) and write ``checksums.json`` on
    rank 0. Collective when torch.distributed is initialized; call it once the files exist."""
    rank, world = _world()
    files = checkpoint_files(ckpt_dir)
    mine = {rel: sha256_file(os.path.join(ckpt_dir, rel)) for rel in files[rank::world]}
    merged = {rel: h for part in gather_objects(mine) for rel, h in part.items()}
    if rank == 0:
        manifest = {"version": 1, "algorithm": "sha256", "files": dict(sorted(merged.items()))}
        with open(os.path.join(ckpt_dir, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


def _read_manifest(ckpt_dir: str) -> dict[str, str] | None:
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ValueError("entries must be file -> hex digest")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"--load: '{path}' is corrupt "
                         f"({type(exc).__name__}: {exc})") from None
    return files


def _first_bad_file(ckpt_dir: str, expected: dict[str, str]) -> str | None:
    """A one-line problem with this rank's share of the files, or None."""
    rank, world = _world()
    for rel in sorted(expected)[rank::world]:
        path = os.path.join(ckpt_dir, rel)
        if ".." in rel.split("/") or os.path.isabs(rel):
            return f"--load: {MANIFEST} in '{ckpt_dir}' names a file outside it: '{rel}'"
        if not os.path.isfile(path):
            return f"--load: checkpoint file '{path}' (listed in {MANIFEST}) is missing"
        if sha256_file(path) != expected[rel]:
            return (f"--load: checkpoint file '{path}' is corrupt (its sha256 differs from "
                    f"{MANIFEST})")
    return None


def check_one_folder(ckpt_dir: str) -> None:
    """Before a save: every rank writes into the same folder (``UsageError`` naming two that
    differ: the shards would be scattered). Collective when torch.distributed is up."""
    folders = gather_objects(os.path.abspath(ckpt_dir))
    if len(set(folders)) > 1:
        other = next(r for r, f in enumerate(folders) if f != folders[0])
        raise UsageError(f"rank 0 saves into '{folders[0]}' but rank {other} into "
                         f"'{folders[other]}': give every rank the same --save")


def verify_saved(ckpt_dir: str) -> None:
    """After ``write_manifest``: every rank sees every file ``checksums.json`` lists (one
    checkpoint, whole, in one folder) before the save is reported; ``UsageError`` naming the
    first missing file. Collective when torch.distributed is up."""
    if dist.is_initialized():
        dist.barrier()  # rank 0 has written the manifest
    try:
        expected = _read_manifest(ckpt_dir)
    except UsageError as exc:
        expected, problem = {}, str(exc).removeprefix("--load: ")
    else:
        problem = None if expected is not None else f"'{ckpt_dir}' has no {MANIFEST}"
    missing = [rel for rel in sorted(expected or {})
               if not os.path.isfile(os.path.join(ckpt_dir, rel))]
    if missing:
        problem = f"'{os.path.join(ckpt_dir, missing[0])}' (listed in {MANIFEST}) is missing"
    problems = [(r, p) for r, p in enumerate(gather_objects(problem)) if p]
    if problems:
        rank, first = problems[0]
        raise UsageError(f"rank {rank} cannot see the checkpoint whole: {first}")


def verify_manifest(ckpt_dir: str) -> bool:
    """Check every file against ``checksums.json``; ``UsageError`` on every rank naming the
    first bad file. Returns False for a checkpoint written before manifests existed."""
    expected = _read_manifest(ckpt_dir)
    if expected is None:
        return False
    problems = [p for p in gather_objects(_first_bad_file(ckpt_dir, expected)) if p]
    if problems:
        raise UsageError(problems[0])
    return True


# ---------------------------------------------------------------- untrusted pickles

_DCP = "torch.distributed.checkpoint."
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id when saved with a Path
    (_DCP + "filesystem", "_StorageInfo"),
    *((_DCP + "metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *((_DCP + "planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
        "LoadItemType")),
}
"""What a torch distributed checkpoint's ``.metadata`` pickle may name: its own dataclasses
and enums, ``torch.Size``, dtypes, layouts and paths -- nothing that can run code."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`_METADATA_GLOBALS` and torch dtypes."""

    def find_class(self, module: str, name: str):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in _METADATA_GLOBALS and not is_dtype:
            raise pickle.UnpicklingError(f"unsupported global {module}.{name}")
        return super().find_class(module, name)


def _why_unsafe(exc: Exception) -> str:
    """The short reason out of a (multi-line) unpickling error."""
    text = str(exc)
    match = re.search(r"unsupported global:? (?:GLOBAL )?([\w.]+)", text, re.IGNORECASE)
    if match:
        return f"it names {match.group(1)}"
    lines = [line.strip() for line in text.splitlines() if "nsupported" in line]
    return f"it is not plain data ({lines[0] if lines else type(exc).__name__})"


def _refuse(path: str, exc: Exception) -> UsageError:
    return UsageError(f"--load: refusing '{path}': {_why_unsafe(exc)}, and unpickling it could "
                      "run code (a checkpoint may hold only tensors and plain data)")


def _unreadable(path: str, exc: Exception) -> UsageError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return UsageError(f"--load: cannot read checkpoint file '{path}': {first}")


def load_metadata_safely(path: str):
    """A torch distributed checkpoint's ``.metadata`` through the restricted unpickler."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        if "unsupported global" in str(exc):
            raise _refuse(path, exc) from None
        raise _unreadable(path, exc) from None
    except Exception as exc:  # truncated or not a pickle at all
        raise _unreadable(path, exc) from None


def _check_weights_only(path: str, source) -> None:
    try:
        torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refuse(path, exc) from None
    except Exception as exc:  # truncated or not a torch file at all
        raise _unreadable(path, exc) from None


def _check_byte_items(ckpt_dir: str, metadata) -> None:
    """Every non-tensor item stored inside the ``*.distcp`` files must be weights-only."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        path = os.path.join(ckpt_dir, info.relative_path)
        if info.transform_descriptors:
            raise UsageError(f"--load: '{path}' stores '{index.fqn}' with transforms "
                             f"{list(info.transform_descriptors)} that cannot be checked")
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        _check_weights_only(f"{path}:{index.fqn}", io.BytesIO(data))


def check_no_code(ckpt_dir: str) -> None:
    """Read every pickle of checkpoint ``ckpt_dir`` the safe way first; ``UsageError`` naming
    the file if one would need arbitrary classes or functions. Not collective."""
    for rel in checkpoint_files(ckpt_dir):
        path = os.path.join(ckpt_dir, rel)
        if rel.endswith(".pt"):
            _check_weights_only(path, path)
        elif rel.endswith(".metadata"):
            _check_byte_items(ckpt_dir, load_metadata_safely(path))


def verify_checkpoint(ckpt_dir: str, unverified: bool = False) -> None:
    """Before anything of ``ckpt_dir`` is unpickled: checksums, then no code. A checkpoint
    without a manifest (older than this check, or copied without it) is refused unless
    ``unverified`` (``--load-unverified``); then it is only checked for code."""
    if not verify_manifest(ckpt_dir):
        if not unverified:
            raise UsageError(f"--load: '{ckpt_dir}' has no {MANIFEST}, so a corrupt file would "
                             "load silently; pass --load-unverified to load it anyway (its "
                             "next save writes one)")
        if _world()[0] == 0:
            print(f"note: loading '{ckpt_dir}' unverified (--load-unverified): it has no "
                  f"{MANIFEST}", flush=True)
    check_no_code(ckpt_dir)
