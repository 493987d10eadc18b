"""build_datasets: sample structure, splits, blending, errors, mock data, torch.distributed."""

import os
import re

import pytest
import torch
import torch.distributed as dist

from megatron_ext.data.datasets import build_datasets
from megatron_ext.data.tokenizer import EOD_TOKEN, build_tokenizer

BYTE = build_tokenizer("byte")


def build(paths, split="1,0,0", samples=(20, 0, 0), seq=16, seed=1, **kwargs):
    return build_datasets(paths, split, seq, seed, samples, BYTE, **kwargs)


def window_text(sample):
    """The seq_length + 1 tokens a sample was cut from, as text."""
    return BYTE.detokenize(sample["tokens"].tolist() + sample["labels"][-1:].tolist())


def test_samples_are_windows_of_the_document_stream(byte_dataset):
    docs = [f"doc {i}: " + "xyz" * (i % 5) for i in range(60)]
    train, valid, test = build([byte_dataset("d", docs)])
    assert valid is None and test is None and len(train) >= 20
    for i in range(len(train)):
        sample = train[i]
        assert sorted(sample) == ["labels", "loss_mask", "position_ids", "tokens"]
        assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
        assert torch.equal(sample["position_ids"], torch.arange(16))
        assert torch.equal(sample["loss_mask"], torch.ones(16))
        pieces = window_text(sample).split(EOD_TOKEN)
        if len(pieces) == 1:  # the window lies inside one document
            assert any(pieces[0] in doc for doc in docs)
        else:
            assert any(doc.endswith(pieces[0]) for doc in docs)
            assert all(piece in docs for piece in pieces[1:-1])  # whole documents in between
            assert any(doc.startswith(pieces[-1]) for doc in docs)


def test_split_assigns_consecutive_document_ranges(byte_dataset):
    prefix = byte_dataset("d", [f"<{i}>" * 4 for i in range(200)])
    train, valid, test = build([prefix], split="80,15,5", samples=(10, 10, 10))
    ranges = {"train": (0, 160), "valid": (160, 190), "test": (190, 200)}
    for name, dataset in zip(ranges, (train, valid, test)):
        low, high = ranges[name]
        assert list(dataset.indices) == list(range(low, high))
        text = "|".join(window_text(dataset[i]) for i in range(len(dataset)))
        seen = {int(n) for n in re.findall(r"<(\d+)>", text)}
        assert seen and all(low <= n < high for n in seen), name


def test_blend_weights_are_respected(byte_dataset):
    prefix_a = byte_dataset("a", ["a" * (10 + i % 20) for i in range(300)])
    prefix_b = byte_dataset("b", ["b" * (10 + i % 20) for i in range(300)])
    train, _, _ = build(["0.7", prefix_a, "0.3", prefix_b], samples=(1000, 0, 0), seq=8)
    from_a = 0
    for i in range(len(train)):
        tokens = set(train[i]["tokens"].tolist()) - {BYTE.eod}
        assert tokens in ({ord("a")}, {ord("b")}, set())
        from_a += ord("a") in tokens
    assert len(train) >= 1000
    assert from_a / len(train) == pytest.approx(0.7, abs=0.03)


def test_missing_dataset_names_the_path(tmp_path, byte_dataset):
    prefix = byte_dataset("d", ["abc"] * 10)
    missing = str(tmp_path / "nope_text_document")
    with pytest.raises(FileNotFoundError) as info:
        build(["0.5", prefix, "0.5", missing])
    assert missing in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="mock"):
        build(None)


def test_same_seed_same_samples_and_cache_dir_is_used(tmp_path, byte_dataset):
    prefix = byte_dataset("d", [f"document {i} " * 3 for i in range(100)])
    first, _, _ = build([prefix], cache_dir=str(tmp_path / "c1"))
    again, _, _ = build([prefix], cache_dir=str(tmp_path / "c2"))
    other, _, _ = build([prefix], seed=2, cache_dir=str(tmp_path / "c3"))
    window = lambda ds: [ds[i]["tokens"].tolist() for i in range(20)]  # noqa: E731
    assert window(first) == window(again) != window(other)
    assert any(name.endswith(".npy") for name in os.listdir(tmp_path / "c1"))


def test_mock_data_needs_no_files():
    train, valid, test = build(None, samples=(10, 5, 5), seq=32, mock=True)
    assert (len(train), len(valid), len(test)) >= (10, 5, 5)
    sample = train[0]
    assert sample["tokens"].shape == (32,)
    assert int(sample["tokens"].max()) < BYTE.vocab_size
    assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])


def test_works_with_torch_distributed_initialised(tmp_path, byte_dataset):
    prefix = byte_dataset("d", [f"document {i} " * 3 for i in range(100)])
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        train, valid, _ = build([prefix], split="9,1,0", samples=(30, 5, 0))
    finally:
        dist.destroy_process_group()
    assert len(train) >= 30 and len(valid) >= 5


@pytest.fixture
def no_hang():
    """A hang (megatron-core's epoch loop on an empty split) fails the test after 60 s."""
    import signal

    def alarm(signum, frame):
        raise TimeoutError("build_datasets hung")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_empty_split_that_is_asked_for_is_one_line(byte_dataset, no_hang):
    prefix = byte_dataset("two", ["hello world", "second tiny doc"])
    with pytest.raises(ValueError, match=re.escape(
            f"--data-path {prefix}: --split 969,30,1 gives the validation split none of its 2 "
            "documents; it needs 17 or more")):
        build([prefix], split="969,30,1", samples=(4, 4, 0))
    assert sorted(os.listdir(os.path.dirname(prefix))) == ["two.jsonl", "two_text_document.bin",
                                                            "two_text_document.idx"]  # no cache


def test_empty_split_no_one_asks_for_is_not_built(byte_dataset, no_hang, capsys):
    # 100 documents: 969,30,1 gives the test split round(100) - round(99.9) = 0 of them
    prefix = byte_dataset("hundred", [f"document {i}" for i in range(100)])
    train, valid, test = build([prefix], split="969,30,1", samples=(20, 4, 0))
    assert test is None and list(valid.indices) == [97, 98, 99]
    assert list(train.indices) == list(range(97))
    assert "note: --split 969,30,1 leaves the test split empty" in capsys.readouterr().out


def test_documents_needed_is_the_first_count_megatron_gives_one():
    from megatron_ext.data.checks import documents_needed, split_documents, split_matrix

    # brute force over megatron-core's own rounding, independent of the search
    for split in ("969,30,1", "98,2,0", "1,1,1", "999,1"):
        for bookends in filter(None, split_matrix(split)):
            first = next(n for n in range(1, 10**5) if split_documents(bookends, n) >= 1)
            empty_below = [n for n in range(1, first) if split_documents(bookends, n) == 0]
            assert len(empty_below) == first - 1
            if first > 1:
                assert documents_needed(bookends, first - 1) == first
    assert documents_needed(split_matrix("969,30,1")[2], 471) == 501  # the 471 docs


def test_token_ids_beyond_the_tokenizer_are_refused(byte_dataset, small_corpus):
    from megatron_ext.data.tokenizer import build_tokenizer

    bpe = build_tokenizer(small_corpus.tokenizer_json)  # 1024 ids: its data fits, not bytes'
    train, _, _ = build_datasets([small_corpus.data_prefix], "1,0,0", 16, 1, (4, 0, 0), bpe)
    assert len(train) >= 4
    with pytest.raises(ValueError, match=r"holds token id \d+, but the tokenizer 'byte' has 257"):
        build_datasets([small_corpus.data_prefix], "1,0,0", 16, 1, (4, 0, 0), BYTE)
    build_datasets([byte_dataset("b", ["abc"])], "1,0,0", 16, 1, (4, 0, 0), bpe)  # 257 < 1024
