"""The embedded stdlib corpus: contents, caching, concurrent builders."""

import json
import multiprocessing
import os
import sysconfig
import time
from pathlib import Path

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data.corpus import (
    CORPUS_VERSION,
    MAX_CORPUS_BYTES,
    default_corpus_dir,
    ensure_default_corpus,
    materialize_corpus,
    stdlib_sources,
)
from megatron_ext.data.tokenizer import EOD_TOKEN, build_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_documents_are_the_first_stdlib_files_in_sorted_order(small_corpus):
    corpus_dir = Path(small_corpus.data_prefix).parent
    with open(corpus_dir / "stdlib.jsonl", encoding="utf-8") as stream:
        records = [json.loads(line) for line in stream]
    paths = [record["path"] for record in records]
    assert small_corpus.num_docs == len(records) == 40
    assert paths == sorted(paths)
    assert paths[0] == "__future__.py"  # the alphabetically first stdlib module
    skipped = {"test", "tests", "site-packages"}
    assert not any(skipped & set(path.split("/")) for path in paths)
    for record in records[:5]:
        assert record["text"] == (STDLIB / record["path"]).read_text(encoding="utf-8")


def test_indexed_dataset_is_the_tokenized_documents(small_corpus):
    dataset = IndexedDataset(small_corpus.data_prefix)
    tokenizer = build_tokenizer(small_corpus.tokenizer_json)
    assert len(dataset) == small_corpus.num_docs
    assert int(dataset.sequence_lengths.sum()) == small_corpus.num_tokens
    first_source = (STDLIB / "__future__.py").read_text(encoding="utf-8")
    assert tokenizer.detokenize(dataset[0]) == first_source + EOD_TOKEN


def test_cached_corpus_is_reused(small_corpus):
    meta = Path(small_corpus.data_prefix).parent / "corpus.json"
    before = meta.stat().st_mtime_ns
    again = ensure_default_corpus(
        cache_dir=str(Path(small_corpus.data_prefix).parents[1]), max_docs=40, vocab_size=1024,
        log=None,
    )
    assert again == small_corpus and meta.stat().st_mtime_ns == before


def test_default_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_EXT_CACHE", str(tmp_path))
    assert default_corpus_dir() == tmp_path / f"default_corpus-{CORPUS_VERSION}"
    assert default_corpus_dir(max_docs=5).name.endswith("-docs5")
    monkeypatch.delenv("MEGATRON_EXT_CACHE")
    assert default_corpus_dir().parent == Path("~/.cache/megatron_ext").expanduser()


def test_sources_respect_the_byte_cap():
    capped = stdlib_sources(max_bytes=200_000)
    assert sum(path.stat().st_size for path in capped) <= 200_000
    assert capped == stdlib_sources()[: len(capped)]


def _build_in_child(out_dir, log_path, results):
    with open(log_path, "w") as log:
        results.put(materialize_corpus(out_dir, vocab_size=300, max_docs=5, log=log))


def test_concurrent_builders_build_once(tmp_path):
    context = multiprocessing.get_context("spawn")  # a fork of pytest would copy its threads
    results = context.Queue()
    out = tmp_path / "corpus"
    children = [
        context.Process(target=_build_in_child, args=(out, tmp_path / f"log{i}", results))
        for i in range(2)
    ]
    for child in children:
        child.start()
    corpora = [results.get(timeout=300) for _ in children]
    for child in children:
        child.join()
    assert corpora[0] == corpora[1] and corpora[0].num_docs == 5
    logs = [(tmp_path / f"log{i}").read_text() for i in range(2)]
    assert sum(log.count("building the default corpus") for log in logs) == 1
    assert sorted(os.listdir(tmp_path)) == ["corpus", "corpus.lock", "log0", "log1"]


def test_corpus_with_other_settings_is_not_reused(small_corpus):
    with pytest.raises(FileExistsError, match="vocab_size=1024"):
        materialize_corpus(Path(small_corpus.data_prefix).parent, vocab_size=300, max_docs=40)


def test_foreign_directory_is_not_overwritten(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="holds no corpus"):
        materialize_corpus(tmp_path / "out", vocab_size=300, max_docs=2, log=None)
    assert os.listdir(tmp_path / "out") == ["mine.txt"]


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("MEGATRON_EXT_SLOW_TESTS"), reason="set MEGATRON_EXT_SLOW_TESTS=1"
)
def test_full_default_corpus(tmp_path):
    start = time.monotonic()
    corpus = ensure_default_corpus(cache_dir=str(tmp_path), log=None)
    seconds = time.monotonic() - start
    meta = json.loads((Path(corpus.data_prefix).parent / "corpus.json").read_text())
    dataset = IndexedDataset(corpus.data_prefix)
    tokenizer = build_tokenizer(corpus.tokenizer_json)
    assert corpus.num_docs == len(dataset) == len(stdlib_sources())
    assert corpus.num_tokens == int(dataset.sequence_lengths.sum())
    assert tokenizer.vocab_size == 4096 and dataset.index.dtype == numpy.uint16
    assert meta["text_bytes"] <= MAX_CORPUS_BYTES
    assert tokenizer.detokenize(dataset[0])[: -len(EOD_TOKEN)] == (
        STDLIB / "__future__.py"
    ).read_text(encoding="utf-8")
    assert seconds < 90
