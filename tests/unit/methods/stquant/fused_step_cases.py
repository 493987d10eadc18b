"""The cases and checks every fused STQuant step is tested with against the torch path (the
Triton kernel under the interpreter, the compiled CPU kernel): ``m``, ``v`` (codes and
scales) bit for bit; the parameter within one float32 ulp plus 2**-21 of its update, because
the kernels take a correctly rounded ``sqrt`` where torch's CPU kernel (MKL's) is off by an
ulp for about a fifth of inputs, which moves the update by about one ulp of itself."""

import itertools

import torch

from megatron_ext.methods.stquant.quantizer import quantize
from megatron_ext.methods.stquant.update import StepScalars, torch_steps

GROUP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False,
             maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
             decoupled_weight_decay=True)


def state(numel, lead, bits, seed):
    """A parameter with its gradient and a stored m, v (heavy-tailed, some exact zeros)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(numel, generator=g) * 2)
    p = torch.randn(numel, generator=g)
    grad = torch.randn(numel, generator=g) * scale * 1e-3
    m = torch.randn(numel, generator=g) * scale * 1e-3
    v = m * m * torch.rand(numel, generator=g) * 4
    for t in (grad, m, v):
        t[: numel // 7] = 0.0  # a coordinate that never had a gradient
    return (p, grad, quantize(m, "linear", bits, 64, lead), quantize(v, "log", bits, 64, lead))


def assert_same(a, b):
    assert a.bits == b.bits and a.numel == b.numel and a.lead == b.lead
    assert torch.equal(a.codes, b.codes)
    assert (a.scales is None and b.scales is None) or torch.equal(a.scales, b.scales)


def assert_close_update(p, p_ref, p0):
    """``p`` within one ulp of ``p_ref`` plus 2**-21 of the update; most elements equal."""
    ulp = torch.nextafter(p_ref.abs(), torch.tensor(float("inf"))) - p_ref.abs()
    bound = ulp.double() + (p_ref.double() - p0.double()).abs() * 2**-21
    assert ((p.double() - p_ref.double()).abs() <= bound).all()
    assert (p != p_ref).double().mean() < 0.05


SHARDS = [(3000, 0, GROUP), (2085, 37, dict(GROUP, betas=(0.3, 0.999)))]
"""``(numel, lead, group)``: on the block grid and off it, ``beta1`` below and above 0.5."""

WIDTHS = [(o, n) for o, n in itertools.product([4, 8, 16, 32], repeat=2) if (o, n) != (32, 32)]
"""Every width change among 4 / 8 / 16 / 32 bits but 32 -> 32 (torch's AdamW in place)."""


def check_against_the_torch_path(fused, old, new, numel, lead, group):
    """One step of ``fused(p, grad, m, v, bits, scalars)`` from ``old`` to ``new`` bits
    against ``torch_steps`` on the same state: codes and scales equal, ``p`` close."""
    p, grad, m_q, v_q = state(numel, lead, old, seed=old * 100 + new)
    p0, p_ref, step = p.clone(), p.clone(), torch.tensor(4.0)
    (m_ref, v_ref), = torch_steps(group, [p_ref], [grad], [m_q], [v_q], new, [step])
    m_new, v_new = fused(p, grad, m_q, v_q, new, StepScalars.of(group, step.item()))
    assert_close_update(p, p_ref, p0)
    assert_same(m_new, m_ref)
    assert_same(v_new, v_ref)
