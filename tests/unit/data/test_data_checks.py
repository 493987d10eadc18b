"""Start-up checks of --data-path: pairing of weights and prefixes, .idx against .bin."""

import os
import subprocess
import sys

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from pretrain_runner import FAST_ARGS, REPO
from megatron_ext.data.checks import check_indexed_dataset, parse_data_path

DOCS = ["first document", "", "x" * 300, "last one"]


def _truncate(path, nbytes):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - nbytes)


def _append(path, data=b"\0\0"):
    with open(path, "ab") as f:
        f.write(data)


def test_a_good_dataset_passes_and_megatron_reads_it(byte_dataset):
    prefix = byte_dataset("d", DOCS)
    check_indexed_dataset(prefix)
    dataset = IndexedDataset(prefix)  # megatron's own reader: the sizes the check assumed
    assert ([len(dataset[i]) for i in range(len(dataset))] ==
            [len(d.encode()) + 1 for d in DOCS])
    assert os.path.getsize(prefix + ".bin") == sum(len(d.encode()) + 1 for d in DOCS) * 2


# DOCS: 14 + 0 + 300 + 8 bytes + 4 EOD = 326 uint16 tokens = 652 bytes of .bin;
# .idx = 34 header + 4 sequences x (4 + 8) + 5 document indices x 8 = 122 bytes
@pytest.mark.parametrize("damage, file, message", [
    (lambda p: _truncate(p + ".bin", 2), ".bin", "is truncated (650 bytes; 'd_text_document.idx' "
                                                  "describes 652 bytes)"),
    (lambda p: _append(p + ".bin"), ".bin", "is longer than its index says"),
    (lambda p: _truncate(p + ".idx", 1), ".idx", "is truncated (121 bytes; its header describes "
                                                 "4 sequences, 4 documents: 122 bytes)"),
    (lambda p: _truncate(p + ".idx", 100), ".idx", "shorter than the 34-byte header"),
    (lambda p: _append(p + ".idx", b"\1"), ".idx", "is longer than its header says"),
    (lambda p: open(p + ".idx", "r+b").write(b"NOTANIDX"), ".idx", "bad header"),
])
def test_damaged_files_are_named(byte_dataset, damage, file, message):
    prefix = byte_dataset("d", DOCS)
    damage(prefix)
    with pytest.raises(ValueError) as info:
        check_indexed_dataset(prefix)
    text = str(info.value)
    assert f"'{prefix}{file}'" in text and message in text and "\n" not in text


def test_truncated_bin_is_what_megatron_would_trip_over(byte_dataset):
    """Independent of the check: megatron's reader really fails on the last document."""
    prefix = byte_dataset("d", DOCS)
    _truncate(prefix + ".bin", 2)
    dataset = IndexedDataset(prefix)
    with pytest.raises(ValueError):
        numpy.asarray(dataset[len(dataset) - 1])


@pytest.mark.parametrize("items, expected", [
    (["a"], (["a"], None)),
    (["a", "b"], (["a", "b"], None)),
    (["0.7", "a", "0.3", "b"], (["a", "b"], [0.7, 0.3])),
    (["1", "a"], (["a"], [1.0])),
])
def test_data_path_forms(items, expected):
    assert parse_data_path(items) == expected


@pytest.mark.parametrize("items, message", [
    (["0.7", "a", "b"], "weights and prefixes are not paired"),
    (["0.7", "a", "b", "0.3"], "weights and prefixes are not paired"),
    (["a", "0.7", "b", "0.3"], "weights and prefixes are not paired"),
    (["0.7", "0.3", "a", "b"], "weights and prefixes are not paired"),
    (["-1", "a", "2", "b"], "weights must be finite, >= 0"),
    (["0", "a", "0", "b"], "not all 0"),
    (["nan", "a"], "weights must be finite"),
])
def test_data_path_mistakes(items, message):
    with pytest.raises(ValueError, match=message):
        parse_data_path(items)


def _pretrain(args):
    return subprocess.run([sys.executable, str(REPO / "pretrain_llama.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONWARNINGS": "ignore"})


@pytest.mark.parametrize("case", ["truncated bin", "unpaired weights"])
def test_pretrain_stops_with_one_line(byte_dataset, tmp_path, case):
    prefix = byte_dataset("d", DOCS * 50)
    if case == "truncated bin":
        _truncate(prefix + ".bin", 2)
        data, message = [prefix], f"dataset file '{prefix}.bin' is truncated"
    else:
        data, message = ["0.7", prefix, prefix], "weights and prefixes are not paired"
    flags = [a for a in FAST_ARGS if a != "--mock-data"]
    proc = _pretrain([*flags, "--train-iters", "2", "--data-path", *data, "--tokenizer-model",
                      "byte", "--run-dir", str(tmp_path / "run")])
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (
        proc.stderr[-3000:])
    assert not (tmp_path / "run").exists()


def test_a_folder_where_a_file_is_expected_is_named_as_such(byte_dataset, tmp_path):
    from megatron_ext.data.preprocess import PreprocessConfig, preprocess
    from megatron_ext.data.tokenizer import build_tokenizer

    prefix = byte_dataset("a", ["one document"])
    os.remove(prefix + ".bin")
    os.mkdir(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"^dataset file is a folder, not a file: .*a_"
                                                r"text_document.bin"):
        check_indexed_dataset(prefix)
    with pytest.raises(FileNotFoundError, match=r"^tokenizer model is a folder, not a file: "):
        build_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"^input file is a folder, not a file: "):
        preprocess(PreprocessConfig(input=str(tmp_path), output_prefix=str(tmp_path / "o")),
                   log=None)


def test_an_empty_train_split_advises_a_larger_train_weight(byte_dataset):
    from megatron_ext.data.checks import empty_splits

    prefix = byte_dataset("two", ["one", "two"])
    (index, reason), = empty_splits(prefix, "1,1000,0")
    assert index == 0 and reason.endswith("it needs 501 or more (or a larger train weight)")
    (index, reason), = empty_splits(prefix, "1000,1,0")
    assert index == 1 and reason.endswith("(or a --split whose validation weight is 0)")
