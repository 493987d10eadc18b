"""pretrain_llama.py plus a probe method that adds a parameter in ``after_model``: a gain on the
final norm's output (shape (1,): no weight decay, so only its gradient can move it)."""

import sys

import torch

from megatron_ext.defaults import default_extensions
from megatron_ext.extension import Extension
from megatron_ext.training.pretrain import main


def gain_method(controller) -> Extension:
    norms = []

    def after_model(args, chunks):
        norm = chunks[-1].decoder.final_layernorm
        norm.probe_gain = torch.nn.Parameter(torch.ones(1, device=norm.weight.device))
        norm.register_forward_hook(lambda module, inputs, out: out * module.probe_gain)
        norms.append(norm)

    def on_step(args, run, state):
        return {"probe_gain": norms[0].probe_gain.item()}

    return Extension("gain", after_model=after_model, on_step=on_step)


if __name__ == "__main__":
    sys.exit(main("llama", extensions=default_extensions(gain_method)))
