"""Deterministic micro-batches for data parallelism, resumable from a sample count.

The rule, as in Megatron-LM's ``MegatronPretrainingSampler``: all ranks walk the same global
sample stream ``0, 1, 2, ...`` (index ``i`` reads ``dataset[i % len(dataset)]``, so the stream
wraps into further epochs of the dataset's own order instead of ending). Each step consumes
``micro_batch_size * data_parallel_size`` consecutive samples and data-parallel rank ``r``
takes the ``r``-th slice of ``micro_batch_size`` of them:

    step with mbs=2, dp=2 over samples 8..11:  rank 0 -> [8, 9],  rank 1 -> [10, 11]

Consequences the tests check:

* The samples a global batch contains depend only on where it starts in the stream, not on
  the data-parallel layout: with the same global batch size, dp=1 x mbs=4 and dp=2 x mbs=2
  see the same samples in the same order (rank 0's slice followed by rank 1's).
* ``consumed_samples`` counts global samples handed out so far; save it in a checkpoint and
  start a new iterator with it (under any data-parallel layout) to continue exactly where
  the uninterrupted run would have.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset


@dataclass
class MicroBatchIterator(Iterator[dict[str, torch.Tensor]]):
    """Endless iterator over this rank's micro-batches (dicts of stacked tensors)."""

    dataset: Dataset
    """A map-style dataset of dicts of same-shaped tensors or numbers, e.g. a ``GPTDataset``
    (or a ``BlendedDataset``, whose samples add a scalar ``dataset_id``)."""
    micro_batch_size: int
    """Samples per micro-batch on one rank."""
    data_parallel_rank: int
    """This rank's index in its data-parallel group, ``0 <= rank < data_parallel_size``."""
    data_parallel_size: int
    """Number of data-parallel ranks sharing each step."""
    consumed_samples: int = 0
    """Global samples consumed before the next step; restore it from a checkpoint to resume."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.data_parallel_size < 1:
            raise ValueError("micro_batch_size and data_parallel_size must be >= 1")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {self.data_parallel_rank} is outside "
                f"[0, {self.data_parallel_size})"
            )
        if len(self.dataset) == 0:
            raise ValueError("the dataset is empty")

    def sample_indices(self) -> list[int]:
        """Dataset indices of this rank's next micro-batch (without consuming it)."""
        start = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        return [(start + i) % len(self.dataset) for i in range(self.micro_batch_size)]

    def __next__(self) -> dict[str, torch.Tensor]:
        samples = [self.dataset[i] for i in self.sample_indices()]
        self.consumed_samples += self.micro_batch_size * self.data_parallel_size
        return {
            key: torch.stack([torch.as_tensor(sample[key]) for sample in samples])
            for key in samples[0]
        }
