"""Cases for the GaussWS Triton kernels on CPU under the Triton interpreter (not collected
directly: ``test_gaussws_triton.py`` runs this file in a fresh process with
``TRITON_INTERPRET=1``, which must be set before triton is first imported). Small shapes:
the interpreter runs about a millisecond per program instance."""

import os

import pytest
import torch

from megatron_ext.methods.gaussws import noise, sampling
from megatron_ext.methods.gaussws.layout import ShardLayout, local_block_amax

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_gaussws_triton.py"

from megatron_ext.methods.gaussws import triton_kernels as tk  # noqa: E402

KEYS = [0, 1, 12345, 2**31 + 5, 2**63 - 1]


@pytest.mark.parametrize("key", KEYS)
def test_noise_is_the_torch_stream(key):
    rows = torch.tensor([0, 1, 2, 31, 32, 77, 4000])
    for col_start, n_cols, full_cols in [(0, 320, 320), (3, 150, 300), (0, 5, 5), (349, 3, 352)]:
        expected = noise.noise_block(rows, col_start, n_cols, full_cols, key)
        assert torch.equal(tk.noise_block(rows, col_start, n_cols, full_cols, key), expected)


LAYOUTS = [
    ShardLayout.full(70, 100),
    ShardLayout.tensor_parallel((128, 352), 2, 1, dim=1),  # tiny fc2, rank 1: 5.5 tiles
    ShardLayout.tensor_parallel((704, 128), 4, 3, dim=0, parts=2),  # SwiGLU fc1 rows
    ShardLayout((200, 90), ((10, 50), (110, 150)), (7, 61), block=16),
]


def _same_bits(a, b):
    """Bit for bit, NaN payloads aside (torch's own casts make 0x7FC0 or 0xFFFF)."""
    nan = torch.isnan(a)
    raw = {torch.float32: torch.int32}.get(a.dtype, torch.int16)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a.view(raw)[~nan], b.view(raw)[~nan])


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


def test_regenerated_noise_for_the_backward_matches():
    layout = ShardLayout.tensor_parallel((128, 352), 2, 1, dim=1)
    rows = layout.global_rows()
    r_torch = noise.noise_block(rows, 176, 176, 352, key=7)
    assert torch.equal(tk.noise_block(rows, 176, 176, 352, 7), r_torch)
