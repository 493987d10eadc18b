"""torchrun worker: build the job of the given flags, take one training step, and write what
each rank holds — bytes of its weights, gradients and optimizer state (Adam's m and v plus
the FP32 main parameters of a BF16 run), local shards only — to ``OUT/rank<r>.json``.

    python -m torch.distributed.run --nproc-per-node N fsdp_memory_worker.py OUT <flags>
"""

import json
import os
import sys

import torch
from megatron.core import parallel_state
from torch.distributed.tensor import DTensor

from megatron_ext.training.arguments import parse_args
from megatron_ext.training.loop import data_iterators, train_step
from megatron_ext.training.pretrain import setup


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the part of ``tensor`` this rank stores."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def held_bytes(model, optimizer) -> dict:
    """weights / grads / optimizer bytes on this rank after a step (see the module docstring)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    stepped = [p for o in inner for g in o.optimizer.param_groups for p in g["params"]]
    main_params = [p for o in inner for g in getattr(o, "fp32_from_float16_groups", [])
                   for p in g]
    states = [v for o in inner for s in o.optimizer.state.values() for v in s.values()
              if torch.is_tensor(v) and v.dim() > 0]  # m and v; not the step counter
    return {"weights": sum(local_bytes(p) for c in model for p in c.parameters()),
            "grads": sum(local_bytes(p.grad) for p in stepped if p.grad is not None),
            "optimizer": sum(map(local_bytes, states)) + sum(map(local_bytes, main_params)),
            "stage": parallel_state.get_pipeline_model_parallel_rank()}


def main(out_dir: str, argv: list[str]) -> None:
    args = parse_args("llama", argv)
    run = setup(args)
    iterator = data_iterators(args, run.datasets[0], 0, len(run.model))
    train_step(args, run.model, run.optimizer, run.scheduler, iterator)
    rank = torch.distributed.get_rank()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(held_bytes(run.model, run.optimizer), f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
