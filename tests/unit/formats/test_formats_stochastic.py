"""Stochastic rounding: one of the two neighbours, unbiased, reproducible per seed."""

import pytest
import torch
from formats_reference import fake_quant_ref

from megatron_ext.formats import fake_quant

SR_FORMATS = [
    "fp4_e2m1@tile128+sr", "fp4_e2m1@block128+sr", "mxfp4+sr", "nvfp4+sr",
    "fp8_e4m3@tile128+sr", "fp6_e2m3@tile128+sr", "int4@tile128+sr", "int8@row+sr",
]  # fmt: skip


def draws(x: torch.Tensor, name: str, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` independent roundings of the row vector ``x`` (one call: ``n`` equal rows,
    each its own scale block, so every row sees the same scales)."""
    gen = torch.Generator().manual_seed(seed)
    return fake_quant(x.expand(n, -1).contiguous(), name, generator=gen)


def row(seed: int, cols: int = 128) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, cols, generator=gen) * torch.exp(torch.randn(1, 1, generator=gen))


@pytest.mark.parametrize("name", SR_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_result_is_one_of_the_two_neighbours(name, dtype):
    x = (torch.randn(130, 200, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    y = fake_quant(x, name, generator=torch.Generator().manual_seed(2))
    nearest = name.removesuffix("+sr")
    down, up = fake_quant_ref(x, nearest, mode="down"), fake_quant_ref(x, nearest, mode="up")
    assert ((y == down) | (y == up)).all()
    assert (y != fake_quant(x, nearest)).any()  # it does not just round to nearest


@pytest.mark.parametrize("name", SR_FORMATS)
def test_unbiased(name):
    """Mean over many draws converges to x: |mean - x| <= 5 sigma, sigma <= step / 2 / sqrt(n).

    Values beyond the largest grid point saturate deterministically (MX blocks, whose
    power-of-two scale leaves (6, 8) * 2**s above E2M1's max, and a block's amax a hair
    above it after the float32 scale rounding); they have no second neighbour and are
    left out."""
    n = 4000
    x = row(3)
    y = draws(x, name, n).double()
    nearest = name.removesuffix("+sr")
    up, down = fake_quant_ref(x, nearest, mode="up")[0], fake_quant_ref(x, nearest, mode="down")[0]
    step = up.double() - down.double()
    keep = step > 0
    assert keep.float().mean() > 0.8
    err = y.mean(0) - x.double()[0]
    sigma = step / 2 / n**0.5
    assert (err.abs() <= 5 * sigma)[keep].all()
    assert abs(err[keep].sum()) <= 5 * sigma[keep].norm()  # no bias overall either


def test_probability_of_rounding_up_is_the_fraction():
    """0.25 of the way from 1.0 to 1.5 (E2M1, scale 1): rounds up 25% of the time."""
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([1.125, 4.0])  # amax 4 -> MX scale 2**(2-2) = 1
    y = draws(x, "mxfp4+sr", 20000)[:, 0]
    assert set(y.unique().tolist()) == {1.0, 1.5}
    assert (y == 1.5).double().mean().item() == pytest.approx(0.25, abs=0.015)


@pytest.mark.parametrize("name", ["fp4_e2m1@tile128+sr", "mxfp4+sr", "nvfp4+sr", "int8@row+sr"])
def test_reproducible_per_seed_and_different_across_seeds(name):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    a = fake_quant(x, name, generator=torch.Generator().manual_seed(7))
    b = fake_quant(x, name, generator=torch.Generator().manual_seed(7))
    c = fake_quant(x, name, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_default_generator_follows_torch_manual_seed():
    x = torch.randn(16, 128)
    torch.manual_seed(123)
    a = fake_quant(x, "fp4_e2m1@tile128+sr")
    torch.manual_seed(123)
    assert torch.equal(a, fake_quant(x, "fp4_e2m1@tile128+sr"))


# nvfp4 is left out: its float32 tensor scale is not recovered exactly from its own
# output (see test_nvfp4_idempotent_up_to_the_tensor_scale_rounding).
@pytest.mark.parametrize("name", [n for n in SR_FORMATS if not n.startswith("nvfp4")])
def test_values_on_the_grid_never_move(name):
    x = torch.randn(130, 256, generator=torch.Generator().manual_seed(5))
    on_grid = fake_quant(x, name.removesuffix("+sr"))
    assert torch.equal(
        fake_quant(on_grid, name, generator=torch.Generator().manual_seed(1)), on_grid
    )
