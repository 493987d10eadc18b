"""Hugging Face model directories: ``config.json`` plus safetensors, one tensor at a time.

Reading: :class:`HFCheckpoint` learns every tensor's file, shape and dtype from the safetensors
headers (nothing else is read), then :meth:`HFCheckpoint.tensor` opens the file, copies out one
tensor and closes it again, so the mapping is dropped and no page of the file stays counted
in this process' memory.

Writing: :class:`HFShardWriter` buffers tensors up to ``max_shard_bytes`` and writes each shard
as soon as it is full, named as ``save_pretrained`` does (``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_ext import io
from megatron_ext.errors import UsageError

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


def read_json(path: str, what: str) -> dict:
    """The JSON object in ``path``; ``UsageError`` naming ``what`` otherwise."""
    try:
        return io.read_json(path)
    except ValueError as exc:
        raise UsageError(f"{what}: {exc}") from None


def write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a safetensors checkpoint is, and what it is (from the header)."""

    file: str
    """Path of the safetensors file holding it."""
    stored_name: str
    """Its name in that file (may differ from the canonical name, e.g. GPT-2 without prefix)."""
    shape: tuple[int, ...]
    """Tensor shape."""
    dtype: torch.dtype
    """Tensor dtype."""


def _weight_files(hf_dir: str) -> list[str]:
    """The safetensors files of ``hf_dir`` (the index's shards, or the single file)."""
    index_path = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        index = read_json(index_path, "--hf-dir")
        files = sorted(set(index.get("weight_map", {}).values()))
        if not files:
            raise UsageError(f"--hf-dir: {INDEX_FILE} lists no shard files")
        for name in files:
            if not os.path.isfile(os.path.join(hf_dir, name)):
                raise UsageError(f"--hf-dir: shard file '{name}' listed in {INDEX_FILE} is missing")
        return [os.path.join(hf_dir, f) for f in files]
    if os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
        return [os.path.join(hf_dir, SINGLE_FILE)]
    raise UsageError(f"--hf-dir: no {SINGLE_FILE} or {INDEX_FILE} in '{hf_dir}' (only "
                     "safetensors checkpoints are supported)")


@contextmanager
def _opened(path: str):
    """``safe_open(path)``; a truncated or corrupt file is one line naming it."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as exc:
        raise UsageError(f"--hf-dir: cannot read '{path}': {exc} (truncated or not a "
                         "safetensors file?)") from None


class HFCheckpoint:
    """The tensors of a Hugging Face safetensors checkpoint, read lazily."""

    def __init__(self, hf_dir: str, canonical_name: Callable[[str], str] = lambda n: n):
        self.tensors: dict[str, TensorInfo] = {}
        for path in _weight_files(hf_dir):
            with _opened(path) as f:
                for stored in f.keys():
                    piece = f.get_slice(stored)
                    name = canonical_name(stored)
                    if name in self.tensors:
                        raise UsageError(f"--hf-dir: tensor '{name}' is stored twice")
                    self.tensors[name] = TensorInfo(path, stored, tuple(piece.get_shape()),
                                                    _DTYPES[piece.get_dtype()])

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (and only it) from disk."""
        info = self.tensors[name]
        with _opened(info.file) as f:
            return f.get_tensor(info.stored_name)

    def meta(self, name: str) -> torch.Tensor:
        """A data-less stand-in with the tensor's shape and dtype (for shape checks)."""
        info = self.tensors[name]
        return torch.empty(info.shape, dtype=info.dtype, device="meta")

    def unmatched(self, used: set[str], ignored: tuple[str, ...]) -> list[str]:
        """Tensors neither ``used`` nor matching an ``ignored`` pattern."""
        return sorted(n for n in self.tensors
                      if n not in used and not any(re.search(p, n) for p in ignored))


def parse_size(text: str) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"1000"`` -> bytes (decimal units, as Hugging Face)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*", text.upper())
    if match is None:
        raise UsageError(f"--max-shard-size: cannot parse '{text}' (e.g. 5GB, 500MB)")
    scale = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[match.group(2)]
    return int(float(match.group(1)) * scale)


class HFShardWriter:
    """safetensors shards of at most ``max_shard_bytes`` each (a bigger tensor gets its own)."""

    def __init__(self, out_dir: str, max_shard_bytes: int):
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _part(self, index: int) -> str:
        return os.path.join(self.out_dir, f".part-{index}.safetensors")

    def _flush(self) -> None:
        part = self._part(len(self.shards))
        save_file(self.pending, part, metadata={"format": "pt"})
        os.chmod(part, 0o644)  # safetensors creates it 0600; readable by all, like config.json
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, give shards their final names (+ index); returns the names."""
        if self.pending:
            self._flush()
        count = len(self.shards)
        names = ([SINGLE_FILE] if count == 1 else
                 [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)])
        for k, name in enumerate(names):
            os.rename(self._part(k), os.path.join(self.out_dir, name))
        if count > 1:
            weight_map = {t: name for name, shard in zip(names, self.shards) for t in shard}
            write_json(os.path.join(self.out_dir, INDEX_FILE),
                       {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map})
        return names
