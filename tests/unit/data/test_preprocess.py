"""JSONL -> .bin/.idx: read back with megatron's IndexedDataset, errors, atomic outputs."""

import importlib
import io
import os
import subprocess
import sys
import threading
from concurrent.futures.process import BrokenProcessPool

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data.preprocess import PreprocessConfig, PreprocessError, preprocess
from megatron_ext.data.tokenizer import ByteTokenizer, build_tokenizer

# the module itself, which the package's function of the same name hides
preprocess_module = importlib.import_module("megatron_ext.data.preprocess")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
DOCS = ["hello world", "héllo ✓\nsecond line", "", "x" * 5000, 'print("a", end="")']


def read_back(prefix):
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))], dataset.index.dtype


def test_byte_output_equals_utf8_bytes_plus_eod(tmp_path, write_jsonl):
    config = PreprocessConfig(
        input=write_jsonl("docs", DOCS), output_prefix=str(tmp_path / "out"), append_eod=True
    )
    result = preprocess(config, log=None)
    documents, dtype = read_back(str(tmp_path / "out_text_document"))
    assert documents == [list(doc.encode("utf-8")) + [256] for doc in DOCS]
    assert dtype == numpy.uint16
    assert result.num_docs == len(DOCS)
    assert result.num_tokens == sum(len(doc.encode("utf-8")) + 1 for doc in DOCS)
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "out_text_document.bin",
                                            "out_text_document.idx"]


def test_trained_tokenizer_with_workers_matches_direct_tokenization(
    tmp_path, write_jsonl, small_corpus
):
    docs = ["x" * 50, "", "héllo ✓\nline", 'print("a")'] * 600  # > 1 chunk of 1024 lines
    config = PreprocessConfig(
        input=write_jsonl("docs", docs),
        output_prefix=str(tmp_path / "out"),
        tokenizer_model=small_corpus.tokenizer_json,
        append_eod=False,
        workers=2,
    )
    preprocess(config, log=None)
    tokenizer = build_tokenizer(small_corpus.tokenizer_json)
    expected = [tokenizer.tokenize(doc) for doc in docs if doc]  # empty docs are not written
    assert read_back(str(tmp_path / "out_text_document"))[0] == expected


_LOCK = threading.Lock()


class _LockingTokenizer(ByteTokenizer):
    """Takes a lock per document, as C libraries take their internal locks."""

    def tokenize(self, text: str) -> list[int]:
        with _LOCK:
            return super().tokenize(text)


def test_workers_do_not_inherit_a_lock_another_thread_holds(tmp_path, write_jsonl):
    """A forked worker would copy ``_LOCK`` held and wait on it forever (the hang CI saw once,
    after ``tokenizers`` had started its thread pool); spawned workers start clean."""
    docs = ["a", "bb", "ccc"] * 700  # 2 chunks, one per worker
    encoder = preprocess_module._Encoder(_LockingTokenizer(), ("text",), False, "docs.jsonl")
    results = []
    encode = threading.Thread(daemon=True, target=lambda: results.extend(
        preprocess_module._encode_file(encoder, write_jsonl("docs", docs), workers=2)))
    with _LOCK:  # held by this thread while the workers start and tokenize
        encode.start()
        encode.join(timeout=120)
    assert not encode.is_alive(), "the workers hung on the copied lock"
    assert [ids.tolist() for chunk, _ in results for [ids] in chunk] == [
        list(doc.encode()) for doc in docs]


class _DyingTokenizer(ByteTokenizer):
    """Ends its process on the text "die", as the kernel's OOM killer would."""

    def tokenize(self, text: str) -> list[int]:
        if text == "die":
            os._exit(1)
        return super().tokenize(text)


def test_a_worker_that_dies_fails_the_run(tmp_path, write_jsonl):
    encoder = preprocess_module._Encoder(_DyingTokenizer(), ("text",), False, "docs.jsonl")
    with pytest.raises(BrokenProcessPool):
        list(preprocess_module._encode_file(encoder, write_jsonl("docs", ["a", "die"]), 2))


def test_eta_leaves_out_the_workers_start(monkeypatch):
    clock = iter([0.0, 3.0, 4.0])  # start; first chunk after 3 s of start-up; the second
    monkeypatch.setattr(preprocess_module.time, "monotonic", lambda: next(clock))
    log = io.StringIO()
    progress = preprocess_module._Progress(total_bytes=100, interval=0.5, stream=log)
    progress.update(docs=1, nbytes=10)
    progress.update(docs=1, nbytes=10)
    # 10 bytes in the second after the first chunk: 80 left take 8 s (not 80 / (20 / 4) = 16)
    assert log.getvalue().splitlines()[-1] == "  2 docs, 20% done, 0.00 MB/s, ETA 8s"


def test_each_json_key_gets_its_own_dataset(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"q": "ab", "a": "c"}\n\n{"q": "d", "a": "ef"}\n')
    config = PreprocessConfig(
        input=str(tmp_path / "in.jsonl"), output_prefix=str(tmp_path / "o"), json_keys=("q", "a")
    )
    result = preprocess(config, log=None)
    assert result.num_docs == 2  # the blank line is skipped
    assert read_back(result.prefixes["q"])[0] == [[97, 98], [100]]
    assert read_back(result.prefixes["a"])[0] == [[99], [101, 102]]


def test_missing_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        preprocess(PreprocessConfig(str(tmp_path / "nope.jsonl"), str(tmp_path / "o")), log=None)


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_json_line_names_its_line_and_keeps_old_output(tmp_path, write_jsonl, workers):
    good = write_jsonl("good", ["old"])
    preprocess(PreprocessConfig(good, str(tmp_path / "o")), log=None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"}\n{"text": \n{"text": "d"}\n')
    with pytest.raises(PreprocessError, match=r"bad\.jsonl:3: invalid JSON"):
        preprocess(PreprocessConfig(str(bad), str(tmp_path / "o"), workers=workers), log=None)
    assert read_back(str(tmp_path / "o_text_document"))[0] == [[111, 108, 100]]  # still "old"
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name]


def test_missing_key_and_non_string_value(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(PreprocessError, match=r"in\.jsonl:2: missing key 'text'"):
        preprocess(PreprocessConfig(str(path), str(tmp_path / "o")), log=None)
    path.write_text('{"text": 3}\n')
    with pytest.raises(PreprocessError, match=r"in\.jsonl:1: key 'text' is not a string"):
        preprocess(PreprocessConfig(str(path), str(tmp_path / "o")), log=None)


def test_cli_bad_line_exits_2_with_one_error_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n')
    run = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(bad),
         "--output-prefix", str(tmp_path / "new" / "deeper" / "o"), "--append-eod"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "bad.jsonl:2: invalid JSON" in errors[0]
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # not even the folders it made for them


def test_documents_without_tokens_are_a_warning(tmp_path, write_jsonl):
    log = io.StringIO()
    config = PreprocessConfig(input=write_jsonl("empty", ["", ""]),
                              output_prefix=str(tmp_path / "empty"))
    assert preprocess(config, log=log).num_tokens == 0
    warning = "warning: 2 documents but 0 tokens: every text under --json-keys text is empty"
    assert warning in log.getvalue()
    log = io.StringIO()
    preprocess(PreprocessConfig(input=write_jsonl("one", ["a"]),
                                output_prefix=str(tmp_path / "one")), log=log)
    assert "warning" not in log.getvalue()
