"""The autograd functions a SNIP observer (:class:`.stats.SiteObserver`) runs a site with:
an identity tap on the module input and the unquantized GEMM, both calling back into it."""

from __future__ import annotations

import torch


class TapInput(torch.autograd.Function):
    """Identity on the module input that records x rows forward and dx rows backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, obs) -> torch.Tensor:
        ctx.obs = obs
        ctx.rows = obs.input_forward(x)
        ctx.norm_gain = obs.take_norm_gain()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx: torch.Tensor):
        ctx.obs.input_backward(ctx.rows, dx, ctx.norm_gain)
        return dx, None


class ObservedGemm(torch.autograd.Function):
    """``y = x @ w.T + b`` unquantized, with the observer's statistics and noise."""

    @staticmethod
    def forward(ctx, x, weight, bias, obs, base: bool):
        output = torch.matmul(x, weight.t())
        if bias is not None:
            output = output + bias
        ctx.obs, ctx.base, ctx.use_bias = obs, base, bias is not None
        ctx.active = obs.active
        ctx.save_for_backward(x, weight)
        return output

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        obs = ctx.obs
        dx = torch.matmul(dy, weight)
        dy2 = dy.contiguous().view(-1, dy.shape[-1])
        x2 = x.contiguous().view(-1, x.shape[-1])
        dw = dy2.t() @ x2
        if ctx.base:
            obs.gemm_backward(x2, dy2, weight)
        if ctx.active:
            obs.accumulate_dw(dw, weight)  # the site may be complete after this
        return dx, dw, dy2.sum(0) if ctx.use_bias else None, None, None
