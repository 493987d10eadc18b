"""pretrain_llama.py plus an extension that holds a 512 MiB tensor, touched, before step 3 only."""

import sys

import torch

from megatron_ext.defaults import default_extensions
from megatron_ext.extension import Extension
from megatron_ext.training.pretrain import main

BIG_MIB = 512


def ballast(controller) -> Extension:
    def before_step(args, run, state):
        if state.iteration == 2:  # before step 3
            big = torch.ones(BIG_MIB * 2 ** 20 // 4)  # every page written
            print(f"ballast: {float(big.sum()):.0f}", flush=True)
            del big

    return Extension("ballast", before_step=before_step)


if __name__ == "__main__":
    sys.exit(main("llama", extensions=default_extensions(ballast)))
