"""Start-up checks of ``--data-path``: its syntax, and each dataset's ``.idx`` against its ``.bin``.

megatron-core reads an indexed dataset lazily (memory maps): a truncated ``.bin`` surfaces as a
55-line traceback at the first batch that reaches past its end, a truncated ``.idx`` as
``buffer is smaller than requested size`` without a file name. These checks read a few bytes
of each file before anything is built and name the file.

The ``.idx`` layout (megatron-core's ``IndexedDatasetBuilder``; all little-endian)::

    9 bytes   b"MMIDIDX\\x00\\x00"
    8 bytes   version (1)
    1 byte    token dtype code (DType)
    8 bytes   S = sequence count
    8 bytes   D = document count + 1
    4 S bytes sequence lengths (int32, in tokens)
    8 S bytes sequence pointers (int64, byte offsets into the .bin, in order)
    8 D bytes document indices (int64: first sequence of each document, then S)

so the ``.idx`` is exactly ``34 + 12 S + 8 D`` bytes, and the ``.bin`` holds exactly the tokens
up to the last sequence's end: ``pointer[S-1] + length[S-1] * itemsize`` bytes. Checking those
two sizes, the header and the ends of the two index arrays costs O(1), whatever the dataset size.
"""

from __future__ import annotations

import math
import os
import struct

import numpy
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix, parse_and_normalize_split)
from megatron.core.datasets.indexed_dataset import DType, get_bin_path, get_idx_path

from megatron_ext.io import why_not_a_file

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_path(items: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron-LM's ``--data-path``: prefixes ``a b``, or weighted ``0.7 a 0.3 b``.
    Returns (prefixes, weights or None), megatron-core's blend; ``ValueError`` (one line) when
    weights and prefixes do not alternate or a weight is not a usable number."""
    numbers = [_number(item) for item in items]
    if all(n is None for n in numbers):
        return list(items), None
    shown = " ".join(items)
    if (len(items) % 2 or any(n is None for n in numbers[::2])
            or any(n is not None for n in numbers[1::2])):
        raise ValueError(f"--data-path {shown}: weights and prefixes are not paired (give "
                         "prefixes only, or WEIGHT PREFIX pairs: 0.7 a 0.3 b)")
    weights = numbers[::2]
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"--data-path {shown}: weights must be finite, >= 0 and not all 0")
    return list(items[1::2]), weights


def _read_header(idx: str, size: int) -> tuple[numpy.dtype, int, int]:
    """(token dtype, S, D) of ``idx``; ``ValueError`` naming it if the header is not valid."""
    with open(idx, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        raise ValueError(f"dataset index '{idx}' is truncated ({size} bytes, shorter than the "
                         f"{_HEADER.size}-byte header)")
    magic, version, code, sequences, documents = _HEADER.unpack(raw)
    if magic != _MAGIC or version != 1:
        raise ValueError(f"'{idx}' is not a megatron indexed-dataset index (bad header)")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError:
        raise ValueError(f"'{idx}' names an unknown token dtype (code {code})") from None
    return numpy.dtype(dtype), sequences, documents


def _array_end(idx: str, offset: int, dtype, count: int) -> numpy.ndarray:
    """The first and last of ``count`` ``dtype`` values stored at ``offset`` in ``idx``."""
    item = numpy.dtype(dtype).itemsize
    first = numpy.fromfile(idx, dtype=dtype, count=1, offset=offset)
    last = numpy.fromfile(idx, dtype=dtype, count=1, offset=offset + (count - 1) * item)
    return numpy.concatenate([first, last]).astype(numpy.int64)


def check_indexed_dataset(prefix: str) -> None:
    """``prefix.idx`` is a complete index and ``prefix.bin`` holds exactly the tokens it
    describes; ``FileNotFoundError`` / ``ValueError`` (one line, naming the file) otherwise."""
    idx, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    for path in (idx, bin_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"dataset file {why_not_a_file(path)}: {path} (data path "
                                    f"{prefix!r})")
    idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_path)
    dtype, sequences, documents = _read_header(idx, idx_size)
    itemsize = dtype.itemsize
    expected = _HEADER.size + 12 * sequences + 8 * documents
    if idx_size != expected:
        state = "truncated" if idx_size < expected else "longer than its header says"
        raise ValueError(f"dataset index '{idx}' is {state} ({idx_size} bytes; its header "
                         f"describes {sequences} sequences, {documents - 1} documents: "
                         f"{expected} bytes)")
    if sequences == 0:
        end = 0
    else:
        lengths = _array_end(idx, _HEADER.size, numpy.int32, sequences)
        pointers = _array_end(idx, _HEADER.size + 4 * sequences, numpy.int64, sequences)
        end = int(pointers[1] + lengths[1] * itemsize)
        if pointers[0] != 0 or lengths.min() < 0 or end < 0:
            raise ValueError(f"dataset index '{idx}' is corrupt (sequence pointers)")
    docs = (_array_end(idx, _HEADER.size + 12 * sequences, numpy.int64, documents)
            if documents else numpy.array([-1, -1]))
    if docs[0] != 0 or docs[1] != sequences:
        raise ValueError(f"dataset index '{idx}' is corrupt (document indices)")
    if bin_size != end:
        state = "truncated" if bin_size < end else "longer than its index says"
        raise ValueError(f"dataset file '{bin_path}' is {state} ({bin_size} bytes; "
                         f"'{os.path.basename(idx)}' describes {end} bytes)")


# ---------------------------------------------------------------- splits of a small dataset

SPLIT_NAMES = ("train", "validation", "test")


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """megatron-core's book-ends of ``--split`` (``None``: a split of weight 0)."""
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def split_documents(bookends: tuple[float, float], count: int) -> int:
    """How many of ``count`` documents megatron-core's rounding gives the split ``bookends``."""
    return int(round(bookends[1] * count)) - int(round(bookends[0] * count))


def documents_needed(bookends: tuple[float, float], count: int) -> int:
    """The fewest documents (more than ``count``) that give the split at least one."""
    needed = count + 1
    while split_documents(bookends, needed) < 1:
        needed += 1
    return needed


def document_count(prefix: str) -> int:
    """The number of sequences (documents, as ``preprocess_data`` writes them) in ``prefix``:
    what megatron-core's ``--split`` cuts (the ``.idx`` header, already checked)."""
    idx = get_idx_path(prefix)
    return _read_header(idx, os.path.getsize(idx))[1]


def empty_splits(prefix: str, split: str) -> list[tuple[int, str]]:
    """``(split index, one-line reason)`` for each split of weight > 0 that gets none of
    ``prefix``'s documents. megatron-core would loop forever on it (a ``GPTDataset`` repeats
    its documents until it has the samples asked for, and no number of epochs of nothing
    does), even when no sample is asked for."""
    count = document_count(prefix)
    found = []
    for i, bookends in enumerate(split_matrix(split)):
        if bookends is not None and split_documents(bookends, count) == 0:
            other = ("a larger train weight" if i == 0
                     else f"a --split whose {SPLIT_NAMES[i]} weight is 0")
            found.append((i, f"--data-path {prefix}: --split {split} gives the "
                             f"{SPLIT_NAMES[i]} split none of its {count} documents; it needs "
                             f"{documents_needed(bookends, count)} or more (or {other})"))
    return found


def check_token_ids(prefix: str, vocab_size: int, tokenizer: str) -> None:
    """Every token id in ``prefix.bin`` is below ``vocab_size`` (the tokenizer's): data
    tokenized with a larger vocabulary would fail at the first forward pass with an
    ``IndexError`` deep in the embedding. ``ValueError`` (one line) naming both otherwise. One
    pass over the memory-mapped file, in chunks (~0.2 s per GB once cached: docs/data.md)."""
    idx, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    dtype = _read_header(idx, os.path.getsize(idx))[0]
    if os.path.getsize(bin_path) == 0:
        return
    tokens = numpy.memmap(bin_path, dtype=dtype, mode="r")
    chunk = 1 << 26
    largest = max(int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk))
    if largest >= vocab_size:
        raise ValueError(f"dataset '{bin_path}' holds token id {largest}, but the tokenizer "
                         f"'{tokenizer}' has {vocab_size} ids: the data was tokenized with "
                         f"another tokenizer (pass that one as --tokenizer-model)")
