"""Train/valid/test GPT datasets from megatron-core's ``BlendedMegatronDatasetBuilder``.

What megatron-core does with the arguments of ``build_datasets``:

* ``data_path`` uses Megatron-LM's ``--data-path`` syntax (parsed, and each dataset's files
  checked, by :mod:`megatron_ext.data.checks`): ``["a"]`` is one dataset;
  ``["0.7", "a", "0.3", "b"]`` draws 70% of the samples of every split from ``a`` and 30%
  from ``b`` (a ``BlendedDataset``);
  ``["a", "b"]`` (no weights) blends in proportion to the datasets' sizes.
* ``split`` (``"969,30,1"``) cuts each dataset's *documents* into consecutive train/valid/test
  ranges in those proportions; a zero weight gives ``None`` for that split. A split that gets
  no document of some dataset (``969,30,1`` leaves the test split of 471 documents empty)
  would hang megatron-core: it is not built if no samples of it are asked for (``None``, one
  ``note:`` line), and a ``ValueError`` naming the documents it needs otherwise.
* ``num_samples[i]`` is how many samples split ``i`` must offer: a ``GPTDataset`` repeats its
  documents for as many epochs as needed (each epoch shuffled with ``seed``), so it can be
  longer than one pass over the data.
* A sample is ``seq_length + 1`` consecutive tokens of the shuffled document stream
  (documents are concatenated, separated by their EOD token), returned as a dict of
  ``tokens``/``labels`` (shifted by one), ``loss_mask`` and ``position_ids``. No
  ``attention_mask`` key is produced (``create_attention_mask=False``): attention is causal.
* The sample indices are cached as ``.npy`` files in ``cache_dir`` (default: a ``cache``
  directory next to each dataset) and reused by later runs with the same arguments and the
  same data files (a dataset preprocessed again rebuilds its indices: ``index_cache``).
* ``mock=True`` builds megatron's ``MockGPTDataset`` (synthetic ``1, 2, 3, ...`` documents)
  and needs no files; megatron then ignores ``split`` and uses ``"1,1,1"``.

With ``torch.distributed`` initialised, megatron builds (and caches) on global rank 0 first,
then every other rank loads from the cache after a barrier, so all ranks must call
``build_datasets`` together. ``is_built_on_rank`` is ``lambda: True``: every rank gets a
dataset and reads its own micro-batches (see ``megatron_ext.data.sampler``).
"""

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

from megatron_ext.data.checks import (SPLIT_NAMES, check_indexed_dataset, check_token_ids,
                                      empty_splits, parse_data_path)
from megatron_ext.data.index_cache import drop_stale_indices, stamp_indices
from megatron_ext.data.tokenizer import Tokenizer


def build_datasets(
    data_path: list[str] | None,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    tokenizer: Tokenizer,
    mock: bool = False,
    cache_dir: str | None = None,
) -> tuple[GPTDataset | None, GPTDataset | None, GPTDataset | None]:
    """Build the (train, valid, test) datasets; a split with zero weight is ``None``.

    Raises:
        ValueError: neither ``data_path`` nor ``mock`` is given.
        FileNotFoundError: a dataset's ``.bin`` or ``.idx`` file is missing.
        ValueError: ``data_path``'s weights and prefixes are not paired, a dataset's
            ``.idx`` and ``.bin`` do not match (truncated, corrupt: see ``data.checks``), holds
            token ids the tokenizer does not have, or gives a split no documents (above).
    """
    if mock:
        blend = None
    elif not data_path:
        raise ValueError("build_datasets needs a data_path (Megatron --data-path) or mock=True")
    else:
        blend = parse_data_path(data_path)
        for prefix in blend[0]:
            check_indexed_dataset(prefix)
            check_token_ids(prefix, tokenizer.vocab_size, tokenizer.path)
    unbuilt = [] if mock else _unneeded_empty_splits(blend[0], split, num_samples)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    for i in unbuilt:  # asked for no samples and would get no documents: not built
        config.split_matrix[i] = None
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    prefixes = blend[0] if blend and rank0 else []
    for prefix in prefixes:  # before megatron-core builds (on rank 0 first) or reads its cache
        drop_stale_indices(prefix, cache_dir)
    builder = BlendedMegatronDatasetBuilder(
        MockGPTDataset if mock else GPTDataset, list(num_samples), lambda: True, config
    )
    train, valid, test = builder.build()
    for prefix in prefixes:
        stamp_indices(prefix, cache_dir)
    return train, valid, test


def _unneeded_empty_splits(prefixes: list[str], split: str,
                           num_samples: tuple[int, int, int]) -> list[int]:
    """The splits some dataset gives no documents (megatron-core would hang on them): those
    asked for no samples are left unbuilt (a one-line notice); any other is a ``ValueError``
    naming the dataset, the split and the documents it needs."""
    unbuilt = set()
    for prefix in prefixes:
        for i, reason in empty_splits(prefix, split):
            if num_samples[i]:
                raise ValueError(reason)
            unbuilt.add(i)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    for i in sorted(unbuilt) if rank0 else ():
        print(f"note: --split {split} leaves the {SPLIT_NAMES[i]} split empty; not built "
              "(no samples of it are used)", flush=True)
    return sorted(unbuilt)

