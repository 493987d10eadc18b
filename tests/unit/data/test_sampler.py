"""MicroBatchIterator: global order, data-parallel slicing, resume, wrap-around."""

import itertools

import pytest
import torch

from megatron_ext.data.datasets import build_datasets
from megatron_ext.data.sampler import MicroBatchIterator
from megatron_ext.data.tokenizer import build_tokenizer


class Numbered(torch.utils.data.Dataset):
    """Sample ``i`` is ``{"tokens": tensor([i, i])}`` so batches show which indices they hold."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return {"tokens": torch.tensor([index, index])}


def indices(batch):
    return batch["tokens"][:, 0].tolist()


def take(iterator, steps):
    return [indices(batch) for batch in itertools.islice(iterator, steps)]


def global_batches(dataset, micro_batch_size, dp_size, consumed, steps):
    """Each step's samples over all data-parallel ranks, rank 0's slice first."""
    ranks = [MicroBatchIterator(dataset, micro_batch_size, r, dp_size, consumed)
             for r in range(dp_size)]
    per_rank = [take(rank, steps) for rank in ranks]
    return [sum((per_rank[r][s] for r in range(dp_size)), []) for s in range(steps)]


def test_sequential_order_with_wrap_around():
    iterator = MicroBatchIterator(Numbered(10), 4, 0, 1)
    assert take(iterator, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert iterator.consumed_samples == 12


def test_rank_takes_its_slice_of_each_step():
    rank1 = MicroBatchIterator(Numbered(100), 2, 1, 3)
    assert take(rank1, 2) == [[2, 3], [8, 9]]
    assert rank1.consumed_samples == 12


def test_global_batches_do_not_depend_on_data_parallel_size():
    dataset = Numbered(37)
    dp1 = global_batches(dataset, micro_batch_size=4, dp_size=1, consumed=0, steps=12)
    dp2 = global_batches(dataset, micro_batch_size=2, dp_size=2, consumed=0, steps=12)
    dp4 = global_batches(dataset, micro_batch_size=1, dp_size=4, consumed=0, steps=12)
    assert dp1 == dp2 == dp4
    assert sum(dp1, []) == [i % 37 for i in range(48)]


@pytest.mark.parametrize("resume_dp", [1, 2, 4])
def test_resume_continues_the_uninterrupted_stream(resume_dp):
    dataset = Numbered(23)
    uninterrupted = global_batches(dataset, 2, 2, consumed=0, steps=10)
    first = MicroBatchIterator(dataset, 2, 0, 2)
    take(first, 4)
    consumed = first.consumed_samples  # what a checkpoint stores
    resumed = global_batches(dataset, 4 // resume_dp, resume_dp, consumed, steps=6)
    assert resumed == uninterrupted[4:]


def test_bad_arguments():
    with pytest.raises(ValueError, match="outside"):
        MicroBatchIterator(Numbered(4), 1, 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        MicroBatchIterator(Numbered(4), 0, 0, 1)
    with pytest.raises(ValueError, match="empty"):
        MicroBatchIterator(Numbered(0), 1, 0, 1)


def test_gpt_dataset_batches(tmp_path, byte_dataset):
    prefix = byte_dataset("d", [f"document {i} " * 5 for i in range(50)])
    train, _, _ = build_datasets([prefix], "1,0,0", 8, 0, (40, 0, 0), build_tokenizer("byte"))
    iterator = MicroBatchIterator(train, 4, 1, 2, consumed_samples=8)
    batch = next(iterator)
    assert sorted(batch) == ["labels", "loss_mask", "position_ids", "tokens"]
    assert batch["tokens"].shape == (4, 8) and batch["tokens"].dtype == torch.long
    assert torch.equal(batch["tokens"][2], train[14]["tokens"])  # 8 consumed + rank 1 * 4 + 2
