"""pretrain_llama.py plus a probe: after step 1 (warm-up's learning rate 0: the weights are
still the layout-invariant init) every rank saves ŵ of its sampled sites — the sampling
transform called as the GEMM calls it, with step 1's key — and where its shard lies."""

import os
import sys

import torch
import torch.distributed as dist

from megatron_ext.defaults import default_extensions
from megatron_ext.extension import Extension
from megatron_ext.precision.layers import quantized_linears
from megatron_ext.training.pretrain import main


def w_hat_probe(controller) -> Extension:
    def on_step(args, run, state):
        if state.iteration != 1:
            return None
        shards = {}
        for sid, module in quantized_linears(run.model).items():
            if hasattr(module, "gaussws"):
                _, w_hat = module.transforms[0](module, None, module.weight)  # recomputable
                layout = module.gaussws.layout
                shards[sid] = (w_hat.value.detach().cpu(), layout.row_ranges, layout.col_range,
                               layout.full_shape)
        torch.save(shards, os.path.join(args.run_dir, f"w_hat_rank{dist.get_rank()}.pt"))
        return None

    return Extension("w_hat_probe", on_step=on_step)


if __name__ == "__main__":
    sys.exit(main("llama", extensions=default_extensions(w_hat_probe)))
