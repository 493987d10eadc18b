"""JSONL -> Megatron indexed dataset (``.bin``/``.idx``), as Megatron-LM's ``preprocess_data.py``.

Input: a JSON-lines file, one JSON object per line (blank lines are skipped). For every key
``K`` in ``json_keys`` the string ``obj[K]`` is one document; its token ids (plus the EOD id
with ``append_eod``) go to ``{output_prefix}_{K}_document.bin`` and the per-document lengths
and offsets to ``.idx``. Both files are written by megatron-core's own
``IndexedDatasetBuilder``, so ``IndexedDataset`` and ``GPTDataset`` read them unchanged. The
token dtype is ``DType.optimal_dtype(vocab_size)``: uint16 below 65500 ids, int32 above.
Documents that tokenize to nothing (empty text without ``append_eod``) are not written.

Outputs are checked for writability before anything is read, written under temporary names
next to the final ones and renamed only after the whole input was read, so an error (bad
line, Ctrl-C) never leaves a half-written dataset, or a new empty folder, behind.

Tokenization runs in ``workers`` processes, in input order, with at most two chunks per worker
in flight. The workers are fresh interpreters (``spawn``; ~3 s each to import torch), never
forks of the calling process: that process may already run threads (``tokenizers`` keeps a
thread pool once it has trained a tokenizer), and a fork that copies a lock another thread
holds hangs the child for good. (A ``forkserver`` avoids that too, but a process forked from
one that started a forkserver cannot use it.) A worker that dies ends the run with an error
instead of a hang (``BrokenProcessPool``).
"""

import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import TextIO

import numpy
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

from megatron_ext.data.tokenizer import Tokenizer, build_tokenizer
from megatron_ext.io import check_output, made_dirs, why_not_a_file

_CHUNK_BYTES = 1 << 20
"""Input is handed to workers in chunks of about this many bytes ..."""
_CHUNK_LINES = 1024
"""... or this many lines, whichever comes first."""


@dataclass
class PreprocessConfig:
    """What to tokenize, with which tokenizer, and where to write it."""

    input: str
    """The JSON-lines file to read."""
    output_prefix: str
    """Output path prefix; key ``K`` is written to ``{output_prefix}_{K}_document.bin/.idx``."""
    tokenizer_model: str | None = None
    """A ``tokenizer.json`` path, or ``None``/``"byte"`` for the byte tokenizer."""
    eod_token: str | None = None
    """The tokenizer.json's end-of-document token (``None``: see ``build_tokenizer``)."""
    json_keys: tuple[str, ...] = ("text",)
    """The keys of each JSON object to tokenize; each gets its own dataset."""
    append_eod: bool = False
    """Append the tokenizer's end-of-document id to every document."""
    workers: int = 1
    """Tokenizer processes; 1 tokenizes in the calling process."""
    log_interval: float = 2.0
    """Seconds between two progress lines."""


@dataclass
class PreprocessResult:
    """What ``preprocess`` wrote."""

    prefixes: dict[str, str]
    """JSON key -> dataset path prefix (pass it to ``IndexedDataset`` or as a data path)."""
    num_docs: int
    """JSON objects read (one document per key each)."""
    num_tokens: int
    """Token ids written, summed over all keys, EOD ids included."""
    seconds: float
    """Wall-clock time of the whole run."""


class PreprocessError(ValueError):
    """An input line that cannot be used; the message starts with ``file:line:``."""


def dataset_prefix(output_prefix: str, key: str) -> str:
    """The Megatron-LM naming of the dataset written for ``key``."""
    return f"{output_prefix}_{key}_document"


def preprocess(config: PreprocessConfig, log: TextIO | None = sys.stderr) -> PreprocessResult:
    """Tokenize ``config.input`` into one indexed dataset per JSON key.

    Progress (documents, % done, MB/s, ETA) goes to ``log`` every ``config.log_interval`` seconds.

    Raises:
        FileNotFoundError: the input file or the tokenizer file is missing.
        UsageError: an output cannot be written (a file where a folder must be, ...).
        PreprocessError: a line is not a JSON object, lacks a key, or its value is no string.
    """
    if not os.path.isfile(config.input):
        raise FileNotFoundError(f"input file {why_not_a_file(config.input)}: {config.input}")
    if config.workers < 1:
        raise ValueError(f"workers must be >= 1, got {config.workers}")
    prefixes = {key: dataset_prefix(config.output_prefix, key) for key in config.json_keys}
    folder = os.path.dirname(os.path.abspath(config.output_prefix))
    check_output(folder, "--output-prefix")
    tokenizer = build_tokenizer(config.tokenizer_model, config.eod_token)
    encoder = _Encoder(tokenizer, config.json_keys, config.append_eod, config.input)
    progress = _Progress(os.path.getsize(config.input), config.log_interval, log)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    with made_dirs(folder), _AtomicWriter(prefixes, dtype) as writer:
        for docs, nbytes in _encode_file(encoder, config.input, config.workers):
            writer.add(docs)
            progress.update(len(docs), nbytes)
        writer.commit()
    seconds = time.monotonic() - progress.start
    if log is not None:
        print(
            f"wrote {progress.docs} docs, {writer.num_tokens} tokens in {seconds:.1f}s "
            f"({progress.docs / max(seconds, 1e-9):.0f} docs/s; vocab {tokenizer.vocab_size}"
            + (f", end of document {tokenizer.eod_token!r} = id {tokenizer.eod}"
               if config.append_eod else "") + ") -> "
            + ", ".join(f"{prefix}.bin/.idx" for prefix in prefixes.values()),
            file=log,
        )
    if log is not None and progress.docs and not writer.num_tokens:
        print(f"warning: {progress.docs} documents but 0 tokens: every text under "
              f"--json-keys {' '.join(config.json_keys)} is empty (and --append-eod is off); "
              "nothing here can be trained on", file=log)
    return PreprocessResult(prefixes, progress.docs, writer.num_tokens, seconds)


class _Encoder:
    """Turns raw input lines into token arrays; runs in the worker processes."""

    def __init__(self, tokenizer: Tokenizer, keys: tuple[str, ...], append_eod: bool, source: str):
        self.tokenizer = tokenizer
        self.keys = keys
        self.append_eod = append_eod
        self.source = source

    def encode_chunk(self, chunk: list[tuple[int, bytes]]) -> tuple[list[list[numpy.ndarray]], int]:
        """``(line_no, line)`` pairs -> (per document: one id array per key, bytes consumed)."""
        docs = [self.encode_line(line_no, line) for line_no, line in chunk if line.strip()]
        return docs, sum(len(line) for _, line in chunk)

    def encode_line(self, line_no: int, line: bytes) -> list[numpy.ndarray]:
        """One JSON line -> one id array per key; errors name the file and line."""
        where = f"{self.source}:{line_no}"
        try:
            obj = json.loads(line)
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
            raise PreprocessError(f"{where}: invalid JSON: {err}") from None
        if not isinstance(obj, dict):
            raise PreprocessError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        arrays = []
        for key in self.keys:
            if key not in obj:
                raise PreprocessError(f"{where}: missing key {key!r} (has {sorted(obj)})")
            if not isinstance(obj[key], str):
                raise PreprocessError(f"{where}: key {key!r} is not a string")
            ids = self.tokenizer.tokenize(obj[key])
            if self.append_eod:
                ids.append(self.tokenizer.eod)
            arrays.append(numpy.asarray(ids, dtype=numpy.int32))
        return arrays


_worker_encoder: _Encoder | None = None
"""The encoder of a worker process, set by ``_init_worker``."""


def _init_worker(encoder: _Encoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(chunk: list[tuple[int, bytes]]) -> tuple[list[list[numpy.ndarray]], int]:
    return _worker_encoder.encode_chunk(chunk)


def _read_chunks(path: str) -> Iterator[list[tuple[int, bytes]]]:
    """Yield the file's lines as ``(1-based line number, raw bytes)`` in chunks."""
    chunk, size = [], 0
    with open(path, "rb") as stream:
        for line_no, line in enumerate(stream, start=1):
            chunk.append((line_no, line))
            size += len(line)
            if size >= _CHUNK_BYTES or len(chunk) >= _CHUNK_LINES:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def _encode_file(encoder: _Encoder, path: str, workers: int):
    """Yield ``encode_chunk`` results for the whole file, in order, using ``workers`` processes."""
    if workers == 1:
        yield from map(encoder.encode_chunk, _read_chunks(path))
        return
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=spawn, initializer=_init_worker,
                             initargs=(encoder,)) as pool:
        in_flight = deque()
        for chunk in _read_chunks(path):
            in_flight.append(pool.submit(_encode_in_worker, chunk))
            if len(in_flight) >= 2 * workers:
                yield in_flight.popleft().result()
        while in_flight:
            yield in_flight.popleft().result()


class _AtomicWriter:
    """One ``IndexedDatasetBuilder`` per key, writing to temporary names until ``commit``."""

    def __init__(self, prefixes: dict[str, str], dtype: type[numpy.number]):
        self.final = list(prefixes.values())
        self.temp = [f"{prefix}.tmp-{os.getpid()}" for prefix in self.final]
        self.dtype = dtype
        self.num_tokens = 0
        self.builders: list[IndexedDatasetBuilder] = []

    def __enter__(self) -> "_AtomicWriter":
        for prefix in self.temp:
            self.builders.append(IndexedDatasetBuilder(get_bin_path(prefix), dtype=self.dtype))
        return self

    def add(self, docs: list[list[numpy.ndarray]]) -> None:
        """Append documents; ``docs[i][k]`` is document ``i``'s ids for key ``k``."""
        for arrays in docs:
            for builder, ids in zip(self.builders, arrays):
                if ids.size:
                    builder.add_document(ids, [ids.size])
                    self.num_tokens += ids.size

    def commit(self) -> None:
        """Write the ``.idx`` files and move everything to its final name."""
        for builder, temp in zip(self.builders, self.temp):
            builder.finalize(get_idx_path(temp))
        for temp, final in zip(self.temp, self.final):
            os.replace(get_bin_path(temp), get_bin_path(final))
            os.replace(get_idx_path(temp), get_idx_path(final))

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            return
        for builder in self.builders:
            builder.data_file.close()
        for temp in self.temp:
            for path in (get_bin_path(temp), get_idx_path(temp)):
                if os.path.exists(path):
                    os.remove(path)


class _Progress:
    """Counts documents and input bytes; prints rate and ETA every ``interval`` seconds. The
    rate is taken from the first chunk's arrival on (spawned workers take seconds to start)."""

    def __init__(self, total_bytes: int, interval: float, stream: TextIO | None):
        self.total_bytes, self.interval, self.stream = total_bytes, interval, stream
        self.start = self.last = time.monotonic()
        self.docs = self.bytes = 0
        self.first: tuple[float, int] | None = None
        """(time, bytes) when the first chunk came back."""

    def update(self, docs: int, nbytes: int) -> None:
        """Account for one more chunk; print a line if ``interval`` has passed."""
        self.docs += docs
        self.bytes += nbytes
        now = time.monotonic()
        self.first = self.first or (now, self.bytes)
        if self.stream is None or now - self.last < self.interval:
            return
        self.last = now
        print(f"  {self.docs} docs, {100 * self.bytes / max(self.total_bytes, 1):.0f}% done, "
              f"{self.rate(now) / 1e6:.2f} MB/s, ETA {self.eta(now):.0f}s",
              file=self.stream, flush=True)

    def rate(self, now: float) -> float:
        """Input bytes per second since the first chunk came back (since the start while
        that chunk is the only one)."""
        since, done = self.first
        if self.bytes == done or now - since <= 0:
            since, done = self.start, 0
        return (self.bytes - done) / max(now - since, 1e-9)

    def eta(self, now: float) -> float:
        """Seconds left at the current rate."""
        return (self.total_bytes - self.bytes) / max(self.rate(now), 1e-9)
