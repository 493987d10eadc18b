"""Data pipeline on megatron-core's datasets: tokenizers, JSONL preprocessing, the embedded
stdlib corpus, train/valid/test GPT datasets and the data-parallel micro-batch iterator.

See docs/data.md for the tools and measured numbers.
"""

from megatron_ext.data.corpus import DefaultCorpus, ensure_default_corpus
from megatron_ext.data.datasets import build_datasets
from megatron_ext.data.preprocess import PreprocessConfig, PreprocessError, preprocess
from megatron_ext.data.sampler import MicroBatchIterator
from megatron_ext.data.tokenizer import EOD_TOKEN, Tokenizer, build_tokenizer

__all__ = [
    "EOD_TOKEN",
    "DefaultCorpus",
    "MicroBatchIterator",
    "PreprocessConfig",
    "PreprocessError",
    "Tokenizer",
    "build_datasets",
    "build_tokenizer",
    "ensure_default_corpus",
    "preprocess",
]
