"""megatron-core's sample-index cache, kept true to the data it indexes and checked writable.

megatron-core caches each dataset's document / sample / shuffle indices as ``.npy`` files in
``--data-cache-path`` (default: ``<prefix>/cache/GPTDataset_indices`` beside the dataset) under
a hash of the path, split, seed, sequence length and tokenizer -- not of the data files. A
dataset preprocessed again into the same prefix would reuse the old index: an ``IndexError``
at the first batch when it has fewer documents, wrong samples when it has as many.

:func:`stamp_indices` keeps a stamp (the ``.bin`` / ``.idx`` sizes and modification times)
beside the cached indices of each dataset; when the files no longer match it (or the indices
predate stamps), :func:`drop_stale_indices` removes the dataset's cached indices before
megatron-core builds, so it builds them again, and a ``note:`` line says so. :func:`check_cache_writable` refuses, before any work, a
cache location that cannot be written (a read-only data folder) in one line naming
``--data-cache-path``.
"""

from __future__ import annotations

import hashlib
import json
import os

from megatron_ext.io import check_output

INDICES = "GPTDataset_indices"


def cache_folder(prefix: str, cache_dir: str | None) -> str:
    """Where megatron-core caches ``prefix``'s indices (its own default without a cache_dir)."""
    return cache_dir or os.path.join(prefix, "cache", INDICES)


def check_cache_writable(prefixes: list[str], cache_dir: str | None) -> None:
    """``UsageError`` naming ``--data-cache-path`` if a dataset's index cache cannot be
    written. Creates nothing."""
    for prefix in prefixes:
        folder = cache_folder(prefix, cache_dir)
        flag = ("--data-cache-path" if cache_dir
                else f"--data-path {prefix}: its index cache beside it (pass --data-cache-path "
                     "to put it elsewhere)")
        check_output(folder, flag)


def _fingerprint(prefix: str) -> dict:
    stats = {ext: os.stat(prefix + ext) for ext in (".bin", ".idx")}
    return {ext: [s.st_size, s.st_mtime_ns] for ext, s in stats.items()}


def _stamp_path(folder: str, prefix: str) -> str:
    key = hashlib.md5(os.path.abspath(prefix).encode()).hexdigest()
    return os.path.join(folder, f"{key}-data_stamp.json")


def _cached_indices(folder: str, prefix: str) -> list[str]:
    """The cached index files (``<hash>-<class>-<split>-*``) whose description names
    ``prefix``."""
    found = []
    for name in os.listdir(folder):
        if not name.endswith("-description.txt"):
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                path = json.load(f).get("dataset_path")
        except (OSError, ValueError, AttributeError):
            continue
        if path and os.path.abspath(path) == os.path.abspath(prefix):
            base = name[:-len("description.txt")]
            found += [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(base)]
    return found


def drop_stale_indices(prefix: str, cache_dir: str | None, log=print) -> bool:
    """Before megatron-core builds: remove ``prefix``'s cached indices unless its stamp
    matches the data files (a cache from before stamps counts as stale). Returns whether
    indices were removed. Not collective: rank 0 calls it (megatron-core then builds on rank 0
    before the others read)."""
    folder = cache_folder(prefix, cache_dir)
    if not os.path.isdir(folder):
        return False
    try:
        with open(_stamp_path(folder, prefix), encoding="utf-8") as f:
            stamped = json.load(f)
    except (OSError, ValueError):
        stamped = None
    stale = _cached_indices(folder, prefix) if stamped != _fingerprint(prefix) else []
    for path in stale:
        os.remove(path)
    if stale and log:
        log(f"note: --data-path {prefix}: its .bin / .idx changed since its sample index was "
            f"cached in '{folder}'; building it again")
    return bool(stale)


def stamp_indices(prefix: str, cache_dir: str | None) -> None:
    """After megatron-core built (or reused) ``prefix``'s indices: stamp them with the data
    files they index. Rank 0 only."""
    folder = cache_folder(prefix, cache_dir)
    if os.path.isdir(folder):
        with open(_stamp_path(folder, prefix), "w", encoding="utf-8") as f:
            json.dump(_fingerprint(prefix), f)
