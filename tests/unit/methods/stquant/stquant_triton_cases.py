"""Cases for STQuant's fused Triton step on CPU under the Triton interpreter (not collected
directly: ``test_stquant_triton.py`` runs this file in a fresh process with
``TRITON_INTERPRET=1``): the kernel against the torch path. ``m``, ``v`` (codes and scales)
are bit for bit; the parameter within one float32 ulp plus 2**-21 of its update: the kernel
takes a correctly rounded ``sqrt`` where torch's CPU kernel (MKL's) is off by an ulp for about
a fifth of inputs, which moves the update by about one ulp of itself."""

import itertools
import os

import pytest
import torch

from megatron_ext.methods.stquant.update import StepScalars, torch_steps
from megatron_ext.methods.stquant.quantizer import quantize

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_stquant_triton.py"

from megatron_ext.methods.stquant import triton_step  # noqa: E402

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


WIDTHS = [(o, n) for o, n in itertools.product([4, 8, 16, 32], repeat=2) if (o, n) != (32, 32)]


@pytest.mark.parametrize("old,new", WIDTHS)
@pytest.mark.parametrize("numel,lead,group", [(3000, 0, GROUP), (2085, 37, dict(GROUP, betas=(0.3, 0.999)))])
def test_kernel_matches_the_torch_path_bit_for_bit(old, new, numel, lead, group):
    p, grad, m_q, v_q = state(numel, lead, old, seed=old * 100 + new)
    p0, p_ref, step = p.clone(), p.clone(), torch.tensor(4.0)
    (m_ref, v_ref), = torch_steps(group, [p_ref], [grad], [m_q], [v_q], new, [step])
    m_new, v_new = triton_step.step(p, grad, m_q, v_q, new, StepScalars.of(group, step.item()))
    assert_close_update(p, p_ref, p0)
    assert_same(m_new, m_ref)
    assert_same(v_new, v_ref)
