"""pretrain_llama.py plus a probe that recomputes every block's gradient norm its own way.

The probe's ``wrap_optimizer`` comes after GNMR's in the extension list, so its ``step``
runs first: it finds each block's weights by parameter *name*
(``decoder.layers.{i}.{self_attention.linear_qkv, ..., mlp.linear_fc2}.weight``, not through
the quantized linears' site ids), takes the float64 norm of the concatenated ``main_grad``
of the four, before the step and again after it (the clipped values), and appends
``{"step", "before": [n_L0, ...], "after": [...]}`` to ``<run dir>/probe_norms.jsonl``.
Single process only (whole gradients, one stage).
"""

import json
import re
import sys
from pathlib import Path

import torch

from megatron_ext.defaults import default_extensions
from megatron_ext.extension import Extension
from megatron_ext.training.pretrain import main

WEIGHT = re.compile(r"decoder\.layers\.(\d+)\.(self_attention\.linear_qkv|self_attention\."
                    r"linear_proj|mlp\.linear_fc1|mlp\.linear_fc2)\.weight$")


def _block_norms(model) -> list[float]:
    grads = {}
    for name, param in model[0].named_parameters():
        match = WEIGHT.search(name)
        if match:
            grads.setdefault(int(match.group(1)), []).append(param.main_grad.reshape(-1))
    return [float(torch.linalg.vector_norm(torch.cat(grads[i]).double()))
            for i in sorted(grads)]


def probe(controller) -> Extension:
    def wrap_optimizer(args, model, optimizer):
        step, count = optimizer.step, [0]

        def probed():
            before = _block_norms(model)
            result = step()
            count[0] += 1
            with open(Path(args.run_dir) / "probe_norms.jsonl", "a") as f:
                f.write(json.dumps({"call": count[0], "before": before,
                                    "after": _block_norms(model)}) + "\n")
            return result

        optimizer.step = probed
        return optimizer

    return Extension("probe", wrap_optimizer=wrap_optimizer)


if __name__ == "__main__":
    sys.exit(main("llama", extensions=default_extensions(probe)))
