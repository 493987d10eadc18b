"""A GaussWS linear that stores no ŵ: y = x ŵᵀ (+ bias), ŵ regenerated in the backward pass.

``F.linear(x, GaussSample.apply(w, ...))`` is correct but autograd keeps ŵ for the dgrad GEMM:
one extra weight copy per sampled layer (the paper's "2 bytes per parameter" in BF16). This
function saves only what already exists (x, w) plus the tile grid of scales (4 bytes per
1024 weights) and rebuilds ŵ from w, the scales and the key when the backward needs it —
the same ŵ bit for bit, since R is counter-based and the add is deterministic:

    forward   ŵ = w + R ⊙ s;  y = x ŵᵀ + bias                 (ŵ freed on return)
    backward  ŵ again;  dx = dy ŵ;  dŵ = dyᵀ x = dw (eq. 2);  db_t from dŵ (eq. 3)

It is the reference for wiring GaussWS beneath a linear that owns its backward (recompute
ŵ there rather than keep it), and what ``benchmarks/gaussws_overhead.py`` times.
"""

from __future__ import annotations

import torch

from .layout import ShardLayout
from .sampling import bits_grad, block_scale, packed_noise, perturb


class SampledLinear(torch.autograd.Function):
    """``SampledLinear.apply(x, w, bias, bits, amax, key, layout, group)``; ``x`` is
    ``(..., in_features)``, ``bias`` may be None; ``amax`` gets no gradient."""

    @staticmethod
    def forward(ctx, x, w, bias, bits, amax, key: int, layout: ShardLayout, group=None):
        dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
        scale = block_scale(amax.to(dtype), bits)
        ctx.save_for_backward(x, w, scale)
        ctx.key, ctx.layout, ctx.group = key, layout, group
        ctx.has_bias, ctx.bits_dtype = bias is not None, bits.dtype
        w_hat = perturb(w, scale, layout, packed_noise(layout, key, w))
        return torch.nn.functional.linear(x, w_hat, bias)

    @staticmethod
    def backward(ctx, dy):
        x, w, scale = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        packed = packed_noise(ctx.layout, ctx.key, w)  # once, for ŵ and for eq. 3
        dx = dw = dbias = dbits = None
        if ctx.needs_input_grad[0]:
            dx = dy @ perturb(w, scale, ctx.layout, packed)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[3]:
            dw = dy2.t() @ x2
        if ctx.needs_input_grad[3]:
            dbits = bits_grad(dw, scale, ctx.layout, packed, ctx.group).to(ctx.bits_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = dy2.sum(0)
        return dx, dw, dbias, dbits, None, None, None, None
