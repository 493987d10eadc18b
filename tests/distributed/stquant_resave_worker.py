"""torchrun worker: build the job of the given flags, load its ``--load`` checkpoint at this
layout, save it again at once, untouched, to ``--save`` (what a DP-resharded load restored,
for a test to compare with what was saved), then train on from it as ``pretrain_llama.py``
would (losses in the run directory's metrics.jsonl).

    python -m torch.distributed.run --nproc-per-node N stquant_resave_worker.py <flags>
"""

import sys

import torch

from megatron_ext.defaults import default_extensions
from megatron_ext.training.loop import train
from megatron_ext.training.metrics import MetricsLogger
from megatron_ext.training.pretrain import parse_and_validate, setup


def main(argv: list[str]) -> None:
    extensions = default_extensions()
    args, _ = parse_and_validate("llama", argv, extensions)  # as pretrain_llama.py parses
    run = setup(args, extensions)
    run.checkpointer.save(run.state)
    rank0 = torch.distributed.get_rank() == 0
    logger = MetricsLogger(args.run_dir, args.train_iters, None) if rank0 else None
    train(args, run, logger, extensions)
    if logger:
        logger.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # the guard matters: dist_checkpointing spawns worker processes
    main(sys.argv[1:])
