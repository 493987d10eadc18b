"""A dataset preprocessed again into the same prefix rebuilds its cached sample index
(data/index_cache.py): megatron-core's cache key has no trace of the data files."""

import numpy
import pytest

from megatron_ext.data.datasets import build_datasets
from megatron_ext.data.index_cache import cache_folder, check_cache_writable
from megatron_ext.data.tokenizer import build_tokenizer
from megatron_ext.errors import UsageError


def _docs(n, word):
    return [f"{word} {i} " * (3 + i % 5) for i in range(n)]


def _train(prefix, cache_dir=None, samples=64):
    train, _, _ = build_datasets([prefix], "1,0,0", 16, 7, (samples, 0, 0),
                                 build_tokenizer("byte"), cache_dir=cache_dir)
    return train


def _tokens(dataset):
    return numpy.stack([dataset[i]["tokens"].numpy() for i in range(len(dataset))])


@pytest.mark.parametrize("before,after", [(200, 60), (60, 200), (60, 60)])
def test_re_preprocessed_dataset_trains_on_its_new_documents(byte_dataset, tmp_path, before,
                                                             after, capsys):
    prefix = byte_dataset("d", _docs(before, "old"))
    _tokens(_train(prefix))  # builds and caches the index of the old files
    assert byte_dataset("d", _docs(after, "new")) == prefix  # same prefix, new files
    fresh = _tokens(_train(prefix, cache_dir=str(tmp_path / "fresh")))
    # the stale index: IndexError (fewer documents) or the old documents' sample boundaries
    assert numpy.array_equal(_tokens(_train(prefix)), fresh)
    assert "its .bin / .idx changed since its sample index was cached" in capsys.readouterr().out
    _train(prefix)  # unchanged since: the cache is reused, no note
    assert "changed" not in capsys.readouterr().out


def test_index_cache_that_cannot_be_written_names_data_cache_path(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(UsageError, match=r"^--data-path .*afile: its index cache beside it "
                                         r"\(pass --data-cache-path to put it elsewhere\): "
                                         r"cannot write"):
        check_cache_writable([str(afile)], None)
    with pytest.raises(UsageError, match=r"^--data-cache-path: cannot write"):
        check_cache_writable(["x"], str(afile / "cache"))
    check_cache_writable([str(tmp_path / "d")], None)
    assert cache_folder("p", None).endswith("p/cache/GPTDataset_indices")
