"""The embedded default corpus: Python's own standard library, tokenized for megatron-core.

Every machine that runs this package has CPython's standard library on disk, so a real,
non-trivial text corpus is available without any download. It is built as follows:

1. **Documents** -- every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, in sorted
   relative-path order, skipping test directories (``test``, ``tests``, ``idle_test``),
   ``site-packages``, the machine-specific ``_sysconfigdata*`` modules and empty files. The
   list stops before the file that would push the text past ``MAX_CORPUS_BYTES`` (24 MiB;
   CPython 3.11 has ~12 MB, so nothing is cut there) or at ``max_docs`` files.
   One JSONL line per file: ``{"text": <source>, "path": <relative path>}``.
2. **Tokenizer** -- a byte-level BPE (``tokenizers``; ByteLevel pre-tokenizer and decoder,
   all 256 bytes in the alphabet, special token ``<|endoftext|>`` = id 0) trained on those
   documents; training is deterministic for a given input.
3. **Indexed dataset** -- ``megatron_ext.data.preprocess`` with ``append_eod``, giving
   ``stdlib_text_document.bin/.idx``.

Caching: ``ensure_default_corpus`` builds into ``<root>/default_corpus-<version>`` where
``<root>`` is ``cache_dir``, else ``$MEGATRON_EXT_CACHE``, else ``~/.cache/megatron_ext``, and
``<version>`` names the corpus recipe and the Python version (``v1-py3.11``); non-default
``max_docs``/``vocab_size`` get their own suffixed directory. The build happens in a
temporary sibling directory renamed into place at the end (``rename`` is atomic), under an
exclusive ``flock`` so that concurrent callers (several ranks) build it once: the others
wait, then load the finished directory. A directory is complete iff its ``corpus.json``
exists.
"""

import fcntl
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from megatron_ext.data.preprocess import PreprocessConfig, preprocess
from megatron_ext.data.tokenizer import EOD_TOKEN

CORPUS_VERSION = f"v1-py{sys.version_info.major}.{sys.version_info.minor}"
"""Recipe version plus the Python version whose stdlib is the text; part of the cache path."""
DEFAULT_VOCAB_SIZE = 4096
"""BPE vocabulary size of the default tokenizer, ``<|endoftext|>`` included."""
MAX_CORPUS_BYTES = 24 * 2**20
"""Upper bound on the corpus text (UTF-8 bytes); keeps the build well under a minute."""
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
_META = "corpus.json"
_PREFIX = "stdlib_text_document"


@dataclass
class DefaultCorpus:
    """Where a built corpus lives and how big it is."""

    data_prefix: str
    """Path prefix of the ``.bin``/``.idx`` pair; use it as a data path."""
    tokenizer_json: str
    """Path of the trained BPE ``tokenizer.json``; pass it to ``build_tokenizer``."""
    num_docs: int
    """Documents (source files) in the corpus."""
    num_tokens: int
    """Tokens in the indexed dataset, one EOD per document included."""


def ensure_default_corpus(
    cache_dir: str | None = None,
    max_docs: int | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    log: TextIO | None = sys.stderr,
) -> DefaultCorpus:
    """Return the default corpus, building and caching it on first use (see module doc)."""
    out_dir = default_corpus_dir(cache_dir, max_docs, vocab_size)
    return materialize_corpus(out_dir, vocab_size, max_docs, log)


def default_corpus_dir(
    cache_dir: str | None = None, max_docs: int | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Path:
    """The cache directory ``ensure_default_corpus`` uses for these settings."""
    root = cache_dir or os.environ.get("MEGATRON_EXT_CACHE") or "~/.cache/megatron_ext"
    name = f"default_corpus-{CORPUS_VERSION}"
    if max_docs is not None:
        name += f"-docs{max_docs}"
    if vocab_size != DEFAULT_VOCAB_SIZE:
        name += f"-vocab{vocab_size}"
    return Path(root).expanduser() / name


def materialize_corpus(
    out_dir: str | Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_docs: int | None = None,
    log: TextIO | None = sys.stderr,
) -> DefaultCorpus:
    """Load the corpus in ``out_dir``, or build it there atomically if it is not complete.

    Raises:
        FileExistsError: ``out_dir`` is not empty and holds no corpus, or one built with
            another ``vocab_size``/``max_docs``.
    """
    out_dir = Path(out_dir).expanduser().resolve()
    if not (out_dir / _META).is_file():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(out_dir.with_name(out_dir.name + ".lock")):
            if not (out_dir / _META).is_file():  # else: another process built it meanwhile
                _build_and_rename(out_dir, vocab_size, max_docs, log)
    meta = json.loads((out_dir / _META).read_text())
    if (meta["vocab_size"], meta["max_docs"]) != (vocab_size, max_docs):
        raise FileExistsError(
            f"{out_dir} holds a corpus with vocab_size={meta['vocab_size']}, "
            f"max_docs={meta['max_docs']}, not {vocab_size}, {max_docs}"
        )
    return load_corpus(out_dir)


def load_corpus(out_dir: str | Path) -> DefaultCorpus:
    """Read a finished corpus directory."""
    out_dir = Path(out_dir)
    meta = json.loads((out_dir / _META).read_text())
    return DefaultCorpus(
        data_prefix=str(out_dir / _PREFIX),
        tokenizer_json=str(out_dir / "tokenizer.json"),
        num_docs=meta["num_docs"],
        num_tokens=meta["num_tokens"],
    )


def stdlib_sources(max_docs: int | None = None, max_bytes: int = MAX_CORPUS_BYTES) -> list[Path]:
    """The standard-library files that make up the corpus, in corpus order (see module doc)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        relative = path.relative_to(root)
        if _SKIPPED_DIRS & set(relative.parts[:-1]) or path.name.startswith("_sysconfigdata"):
            continue
        size = path.stat().st_size
        if size == 0:
            continue
        if total + size > max_bytes or (max_docs is not None and len(chosen) == max_docs):
            break
        chosen.append(path)
        total += size
    return chosen


def train_tokenizer(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Train the byte-level BPE tokenizer of the default corpus on ``texts``."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _build_and_rename(
    out_dir: Path, vocab_size: int, max_docs: int | None, log: TextIO | None
) -> None:
    """Build in a temporary sibling directory, then rename it to ``out_dir``."""
    temp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        _build(temp, vocab_size, max_docs, log)
        temp.chmod(0o755)  # mkdtemp makes it private; a cache is meant to be read by others
        try:
            os.rename(temp, out_dir)  # atomic; replaces out_dir only if it is an empty directory
        except OSError:
            if not (out_dir / _META).is_file():  # not a lost race: a foreign non-empty dir
                raise FileExistsError(f"{out_dir} exists and holds no corpus") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _build(out_dir: Path, vocab_size: int, max_docs: int | None, log: TextIO | None) -> None:
    """Write documents, tokenizer, indexed dataset and ``corpus.json`` into ``out_dir``."""
    start = time.monotonic()
    _say(log, f"building the default corpus in {out_dir}")
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = stdlib_sources(max_docs)
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in sources]
    with open(out_dir / "stdlib.jsonl", "w", encoding="utf-8") as jsonl:
        for path, text in zip(sources, texts):
            relative = path.relative_to(root).as_posix()
            jsonl.write(json.dumps({"text": text, "path": relative}) + "\n")
    text_bytes = sum(len(text.encode("utf-8")) for text in texts)
    _say(log, f"  {len(texts)} documents, {text_bytes / 1e6:.1f} MB of text from {root}")
    _say(log, f"  training BPE tokenizer (vocab {vocab_size})")
    train_tokenizer(texts, vocab_size).save(str(out_dir / "tokenizer.json"))
    _say(log, "  tokenizing")
    result = preprocess(
        PreprocessConfig(
            input=str(out_dir / "stdlib.jsonl"),
            output_prefix=str(out_dir / "stdlib"),
            tokenizer_model=str(out_dir / "tokenizer.json"),
            append_eod=True,
            workers=min(os.cpu_count() or 1, 8),
        ),
        log=log,
    )
    meta = {
        "version": CORPUS_VERSION,
        "stdlib": str(root),
        "num_docs": result.num_docs,
        "num_tokens": result.num_tokens,
        "text_bytes": text_bytes,
        "vocab_size": vocab_size,
        "max_docs": max_docs,
        "build_seconds": round(time.monotonic() - start, 1),
    }
    (out_dir / _META).write_text(json.dumps(meta, indent=2) + "\n")
    _say(log, f"  done in {meta['build_seconds']}s: {result.num_tokens} tokens")


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the ``with`` block."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _say(log: TextIO | None, message: str) -> None:
    if log is not None:
        print(message, file=log, flush=True)
