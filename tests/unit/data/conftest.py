"""Shared fixtures: a small default corpus (first stdlib files) and small JSONL datasets."""

import json

import pytest

from megatron_ext.data.corpus import ensure_default_corpus
from megatron_ext.data.preprocess import PreprocessConfig, preprocess

SMALL_CORPUS_DOCS = 40
SMALL_VOCAB = 1024


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """The default-corpus recipe on the first 40 stdlib files, with a 1024-token BPE."""
    cache = tmp_path_factory.mktemp("corpus_cache")
    return ensure_default_corpus(
        cache_dir=str(cache), max_docs=SMALL_CORPUS_DOCS, vocab_size=SMALL_VOCAB, log=None
    )


@pytest.fixture
def write_jsonl(tmp_path):
    """``write_jsonl(name, docs, key="text") -> path``: one JSON object per document."""

    def write(name, docs, key="text"):
        path = tmp_path / f"{name}.jsonl"
        with open(path, "w", encoding="utf-8") as stream:
            for doc in docs:
                stream.write(json.dumps({key: doc}) + "\n")
        return str(path)

    return write


@pytest.fixture
def byte_dataset(tmp_path, write_jsonl):
    """``byte_dataset(name, docs) -> prefix``: docs preprocessed with the byte tokenizer + EOD."""

    def build(name, docs):
        config = PreprocessConfig(
            input=write_jsonl(name, docs), output_prefix=str(tmp_path / name), append_eod=True
        )
        return preprocess(config, log=None).prefixes["text"]

    return build


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: builds the full default corpus; runs only with MEGATRON_EXT_SLOW_TESTS=1"
    )
