"""Tokenizer and train / validation datasets for a run (the embedded corpus by default)."""

from __future__ import annotations

import argparse

import torch.distributed as dist

from megatron_ext.data.corpus import ensure_default_corpus
from megatron_ext.data.datasets import build_datasets
from megatron_ext.data.tokenizer import build_tokenizer
from megatron_ext.errors import UsageError


def _default_corpus_on_rank0_first():
    """Rank 0 builds (or finds) the cached corpus; the others then read the same files."""
    if dist.get_rank() == 0:
        corpus = ensure_default_corpus()
    dist.barrier()
    if dist.get_rank() != 0:
        corpus = ensure_default_corpus()
    return corpus


def build_data(args: argparse.Namespace):
    """Returns (tokenizer, train dataset, validation dataset); UsageError on missing inputs."""
    data_path = args.data_path
    tokenizer_model = args.tokenizer_model
    if not args.mock_data and not data_path:
        corpus = _default_corpus_on_rank0_first()
        data_path = [corpus.data_prefix]
        tokenizer_model = tokenizer_model or corpus.tokenizer_json
    elif data_path and tokenizer_model is None:
        raise UsageError("--data-path needs --tokenizer-model (the tokenizer.json, or 'byte', "
                         "the data was preprocessed with)")
    try:
        tokenizer = build_tokenizer(tokenizer_model, args.eod_token)
        train, valid, _ = build_datasets(
            data_path, args.split, args.seq_length, args.seed,
            (args.train_iters * args.global_batch_size,
             args.eval_iters * args.global_batch_size, 0),
            tokenizer, mock=args.mock_data, cache_dir=args.data_cache_path)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    if valid is None and args.eval_iters:
        raise UsageError(f"--split {args.split} leaves no validation data; use --eval-iters 0")
    return tokenizer, train, valid
