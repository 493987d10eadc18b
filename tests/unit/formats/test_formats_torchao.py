"""MX and NVFP4 bit for bit against torchao's emulation (torchao.prototype.mx_formats).

CI installs torchao without its dependencies so that torch stays pinned:
``pip install --no-deps torchao==0.18.0``.

Known, deliberate differences (finite, normal-range inputs are bit-identical):
* a block whose E8M0 scale is 2**-127 (amax < 2**(emax - 126)): torchao quantizes with
  2**-126 but dequantizes with 2**-127, halving the values; we use 2**-127 both ways;
* NaN / inf: torchao turns a block holding a NaN into all-NaN and an inf into inf with
  its block-mates flushed to zero; here NaN and inf pass through and the block is scaled
  by its finite values.
"""

import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

from megatron_ext.formats import fake_quant

MX = {
    "mxfp4": torch.float4_e2m1fn_x2,
    "mxfp8": torch.float8_e4m3fn,
    "mxfp8_e5m2": torch.float8_e5m2,
    "mxfp6_e3m2": DTYPE_FP6_E3M2,
    "mxfp6_e2m3": DTYPE_FP6_E2M3,
}


def torchao_mx(x: torch.Tensor, elem_dtype) -> torch.Tensor:
    scale, data = to_mx(x, elem_dtype, 32)  # default ScaleCalculationMode.FLOOR
    return to_dtype(data, scale, elem_dtype, 32, x.dtype)


def torchao_nvfp4(x: torch.Tensor) -> torch.Tensor:
    t = per_tensor_amax_to_scale(x.abs().max())
    scale, data = nvfp4_quantize(x, 16, t)
    q = f4_unpacked_to_f32(unpack_uint4(data)).view(x.shape[0], -1, 16)
    return (q * (t * scale.to(torch.float32)).unsqueeze(-1)).view(x.shape).to(x.dtype)


def inputs(dtype):
    """Blocks spanning 2**-60 .. 2**60, exact zeros, signed zeros, ties and subnormal
    fp32 values inside otherwise normal blocks."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 256, generator=gen) * torch.exp2(
        torch.randint(-60, 60, (96, 1), generator=gen).float()
    )
    x[0] = 0.0
    x[1] = -0.0
    x[2, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 6.0] + [0.0] * 22)
    x[3, :32] = torch.randn(32, generator=gen) * 2.0**-140  # subnormal values
    x[3, 0] = 1.0
    x[4, :32] = torch.randn(32, generator=gen) * 1e-3
    x[4, 5] = -1e-30  # rounds to -0.0
    return x.to(dtype)


def assert_same_bits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    view = torch.int16 if ours.element_size() == 2 else torch.int32
    diff = (ours.view(view) != theirs.view(view)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} differ, first at {diff[:3].tolist()}"


@pytest.mark.parametrize("name", MX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mx_bit_for_bit(name, dtype):
    x = inputs(dtype)
    assert_same_bits(fake_quant(x, name), torchao_mx(x, MX[name]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nvfp4_bit_for_bit(dtype):
    x = inputs(dtype)[5:]  # leave out rows of zeros (torchao's tensor scale would be 0)
    assert_same_bits(fake_quant(x, "nvfp4"), torchao_nvfp4(x))


def test_mx_rank3_along_last_axis():
    x = inputs(torch.float32).view(8, 12, 256)
    assert_same_bits(fake_quant(x, "mxfp4"), torchao_mx(x, MX["mxfp4"]))
