"""Cases for the GaussWS Triton kernels on CPU under the Triton interpreter (not collected
directly: ``test_gaussws_triton.py`` runs this file in a fresh process with
``TRITON_INTERPRET=1``, which must be set before triton is first imported). Small shapes:
the interpreter runs about a millisecond per program instance."""

import os

import pytest
import torch

from megatron_ext.methods.gaussws import noise, sampling
from megatron_ext.methods.gaussws.layout import ShardLayout, local_block_amax, segment_reduce

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_gaussws_triton.py"

from megatron_ext.methods.gaussws import triton_kernels as tk  # noqa: E402

KEYS = [0, 1, 12345, 2**31 + 5, 2**63 - 1]


LAYOUTS = [
    ShardLayout.full(70, 100),
    ShardLayout.tensor_parallel((128, 352), 2, 1, dim=1),  # tiny fc2, rank 1: 5.5 tiles
    ShardLayout.tensor_parallel((704, 128), 4, 3, dim=0, parts=2),  # SwiGLU fc1 rows
    ShardLayout((200, 90), ((10, 50), (110, 150)), (7, 61), block=16),
    ShardLayout((90, 75), ((0, 90),), (10, 75), block=24),  # a tile side not a power of two
]


def _same_bits(a, b):
    """Bit for bit, NaN payloads aside (torch's own casts make 0x7FC0 or 0xFFFF)."""
    nan = torch.isnan(a)
    raw = {torch.float32: torch.int32}.get(a.dtype, torch.int16)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a.view(raw)[~nan], b.view(raw)[~nan])


@pytest.mark.parametrize("key", KEYS)
def test_noise_is_the_torch_stream(key):
    """ŵ of a zero weight with s = 1 is R itself: the kernel's R against the torch stream."""
    for layout in [ShardLayout.full(33, 320), ShardLayout((40, 300), ((3, 40),), (3, 153)),
                   ShardLayout((4001, 352), ((3998, 4001),), (349, 352))]:
        rows, (c0, c1) = layout.global_rows(), layout.col_range
        expected = noise.noise_block(rows, c0, c1 - c0, layout.full_shape[1], key)
        ones = torch.ones(layout.grid_shape)
        assert torch.equal(tk.perturb(torch.zeros(layout.shape), ones, layout, key), expected)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_perturb_is_the_torch_path_bit_for_bit(layout, dtype):
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(layout.shape, generator=gen) * torch.rand(layout.shape[0], 1) * 4)
    w[0, :5] = 0.0
    w = w.to(dtype)
    bits = 2 + 6 * torch.rand(layout.grid_shape, generator=gen)
    scale = sampling.block_scale(local_block_amax(w, layout), bits)
    expected = sampling.perturb(w, scale, layout, 99)  # the torch path (CPU tensor)
    assert _same_bits(tk.perturb(w, scale, layout, 99), expected)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, near max
def test_perturb_rounding_at_the_bfloat16_edges():
    layout = ShardLayout.full(32, 64)
    w = torch.full((32, 64), 3.3895e38).bfloat16()  # near the largest finite bf16
    w[1] = float("inf")
    w[2, :4] = torch.tensor([1.0, -1.0, 2.0**-133, -1e-39])  # bf16 subnormals
    w[3, :2] = float("nan")
    scale = torch.tensor([[1e38, 2.0**-140]], dtype=torch.float32)
    got, expected = tk.perturb(w, scale, layout, 3), sampling.perturb(w, scale, layout, 3)
    assert _same_bits(got, expected) and torch.isinf(got).any()
    assert got[2, 2] != 0 and torch.isnan(got[3, 0])


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_eq3_sums_match_float64(layout, dtype):
    grad = torch.randn(layout.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    rows, (c0, c1) = layout.global_rows(), layout.col_range
    r = noise.noise_block(rows, c0, c1 - c0, layout.full_shape[1], 11, torch.float64)
    prod = r * grad.double()
    expected = segment_reduce(prod, 1, c0, layout.block, "sum")
    bound = segment_reduce(prod.abs(), 1, c0, layout.block, "sum") * layout.block * 2.0**-24
    got = tk.noise_dot(grad, rows, layout, 11)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert ((got.double() - expected).abs() <= bound).all()
    assert expected.abs().sum() > 0  # R is not all zero here
