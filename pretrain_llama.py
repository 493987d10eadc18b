"""Pretrain a Llama model with megatron-core on CPU (gloo) or GPU (NCCL).

    python pretrain_llama.py                      # tiny model, embedded corpus, CPU
    torchrun --nproc-per-node 4 pretrain_llama.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2

See `python pretrain_llama.py --help` for every flag.
"""

import sys

from megatron_ext.defaults import default_extensions
from megatron_ext.training.pretrain import main

if __name__ == "__main__":  # the guard matters: dist_checkpointing spawns worker processes
    sys.exit(main("llama", extensions=default_extensions()))
