"""The logits GEMM quantized (``--pgq-logits``): the output layer's GEMM runs through the
platform's :func:`~megatron_ext.precision.gemm.quantized_gemm` with the recipe's formats.

Plans hold the transformer layers' linear sites only; the output layer (megatron's
``ColumnParallelLinear``, hidden -> vocabulary) is not one of them. PGQ makes it quantizable
the way its profile observes it: an instance attribute ``_forward_impl`` shadowing megatron's
method on every local model chunk's output layer, so the GEMM sees exactly what megatron's
would (the TP input mapping included; a tied output layer gets the embedding table as its
``weight`` argument, as in megatron). Passthrough formats (or None) restore megatron's GEMM.
"""

from __future__ import annotations

from functools import partial

from megatron.core.models.gpt import GPTModel

from megatron_ext.precision.gemm import quantized_gemm
from megatron_ext.precision.layers import sequence_group, tp_input
from megatron_ext.precision.site_formats import SiteFormats, resolve


def _quantized_impl(ops, layer, input, weight, **kwargs):
    return quantized_gemm(tp_input(input, kwargs), weight, kwargs["bias"], ops,
                          kwargs["tp_group"], seq_group=sequence_group(kwargs))


def output_layers(model) -> list:
    """The output layers of ``model``'s local chunks (a list of chunks, DDP-wrapped or not)."""
    return [m.output_layer for chunk in model for m in chunk.modules()
            if isinstance(m, GPTModel) and m.post_process]


def quantize_logits(model, formats: SiteFormats | None) -> None:
    """Run every local output layer's GEMM in ``formats`` from now on (None: megatron's)."""
    ops = None if formats is None else resolve(formats)
    for layer in output_layers(model):
        if "_forward_impl" in vars(layer):
            del layer._forward_impl
        if ops is not None and not ops.passthrough:
            layer._forward_impl = partial(_quantized_impl, ops, layer)
