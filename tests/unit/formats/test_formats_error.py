"""``error_sums``: the three sums against brute force in Python floats (CPU path; the Triton
pass is checked against this path in ``triton_interpreter_cases.py``)."""

import math

import pytest
import torch

from megatron_ext.formats import error_sums, fake_quant


def test_error_sums_by_hand_and_against_brute_force():
    t = torch.tensor([0.0, 1.0, -2.0, 0.5, -0.0])
    q = torch.tensor([0.0, 0.0, -2.0, 1.0, 0.0])
    assert error_sums(t, q).tolist() == [1.0, 1.25, 5.25]
    assert error_sums(t, q, underflow=False).tolist() == [0.0, 1.25, 5.25]
    x = torch.randn(33, 70, generator=torch.Generator().manual_seed(0)).bfloat16()
    q = fake_quant(x, "fp4_e2m1@tile128")
    a, b = x.double().view(-1).tolist(), q.double().view(-1).tolist()
    brute = [sum(u != 0 and v == 0 for u, v in zip(a, b)),
             math.fsum((u - v) ** 2 for u, v in zip(a, b)), math.fsum(u * u for u in a)]
    assert error_sums(x, q).tolist() == pytest.approx(brute, rel=1e-13)
    assert error_sums(x.t(), q.t()).tolist() == pytest.approx(brute, rel=1e-13)


def test_error_sums_needs_one_shape():
    with pytest.raises(ValueError, match="differ"):
        error_sums(torch.zeros(2, 3), torch.zeros(3, 2))
