"""Test launcher: the Llama entry point with the precision platform alone (no method, no
fault handling). Used by the precision tests and benchmarks."""

import sys

from megatron_ext.precision.extension import precision_extension
from megatron_ext.training.pretrain import main

if __name__ == "__main__":  # dist_checkpointing spawns workers: keep the guard
    sys.exit(main("llama", extensions=[precision_extension()]))
