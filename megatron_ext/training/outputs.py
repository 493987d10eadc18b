"""A training run's outputs, checked before any work starts.

``--save /unwritable`` used to be discovered at the final save, after the whole run; a
``--run-dir`` under a file at the first metrics line. :func:`check_run_outputs` probes every
folder the run will write into (creating none of them: a bad path leaves nothing behind) and
stops with one line naming the flag. Who writes what decides who checks it: rank 0 writes the
run folder and TensorBoard, every rank writes its shards of a checkpoint.
"""

from __future__ import annotations

import argparse

from megatron_ext.data.checks import parse_data_path
from megatron_ext.data.index_cache import check_cache_writable
from megatron_ext.io import check_output


def _prefixes(data_path: list[str]) -> list[str]:
    """The datasets of ``--data-path`` (none if it is malformed: the data build says why)."""
    try:
        return parse_data_path(data_path)[0]
    except ValueError:
        return []


def check_run_outputs(args: argparse.Namespace, rank: int) -> None:
    """``UsageError`` (one line) if ``--run-dir``, ``--tensorboard-dir``, ``--data-cache-path``
    or, without it, the index cache beside each ``--data-path`` dataset (rank 0: megatron-core
    builds the dataset caches there) or ``--save`` (every rank) cannot be written. Not
    collective."""
    if rank == 0:
        check_output(args.run_dir, "--run-dir")
        for flag in ("tensorboard_dir", "data_cache_path"):
            if getattr(args, flag):
                check_output(getattr(args, flag), f"--{flag.replace('_', '-')}")
        if args.data_path and not args.mock_data:
            check_cache_writable(_prefixes(args.data_path), args.data_cache_path)
    if args.save:
        check_output(args.save, "--save")
