"""``to_fp8``: the FP8 data and scales a real FP8 GEMM reads, against ``quantize`` (the
reference that stores FP8 codes) and ``fake_quant`` (``data * scale`` must equal it)."""

import pytest
import torch

from megatron_ext.formats import fake_quant, get_format, quantize
from megatron_ext.formats.fp8 import FP8_DTYPES, is_fp8_format, to_fp8, to_fp8_pair

FORMATS = ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3@row", "fp8_e5m2@row", "fp8_e4m3@tile128",
           "fp8_e4m3@block128", "fp8_e5m2@tile128"]


def _input(rows, cols, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 3)
    x[0, :7] = 0.0
    x[1, 2] = -0.0
    x[2, 3] = 3e-39 if dtype == torch.float32 else 1e-30  # subnormal input / tiny value
    x[3, :] = 0.0  # an all-zero row (row scaling: the smallest d)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_data_are_quantizes_codes_and_scales_its_scales(name, transposed, dtype):
    fmt = get_format(name)
    x = _input(256, 384, dtype)
    operand = x.t().contiguous().t() if transposed else x  # a transposed view, read in place
    got = to_fp8(operand, fmt)
    ref = quantize(x, fmt, axis=-1)
    assert got.data.dtype == FP8_DTYPES[fmt.element.name] and got.data.is_contiguous()
    assert torch.equal(got.data.view(torch.uint8), ref.codes)
    assert torch.equal(got.scale, ref.scales.float())
    rows, cols = got.data.shape
    blocks = got.data.float().view(got.scale.shape[0], -1, got.scale.shape[1], cols // got.scale.shape[1])
    dequantized = (blocks * got.scale[:, None, :, None]).view(rows, cols)
    assert torch.equal(dequantized.to(dtype), fake_quant(x, fmt, axis=-1))


def test_a_shards_tensor_amax_sets_the_scale():
    fmt = get_format("fp8_e4m3")
    x = _input(64, 64, torch.float32)
    whole = torch.tensor(4 * x.abs().max().item())
    got = to_fp8(x, fmt, tensor_amax=whole)
    assert got.scale.item() == pytest.approx(whole.item() / 448, rel=2**-20)
    assert torch.equal(got.data.float() * got.scale, fake_quant(x, fmt, tensor_amax=whole))


def test_what_is_not_an_fp8_operand_is_refused():
    assert not any(is_fp8_format(get_format(n)) for n in
                   ["mxfp8", "fp8_e4m3@tile128+sr", "fp4_e2m1", "bf16", "int8@row"])
    with pytest.raises(ValueError, match="not an amax-scaled FP8"):
        to_fp8(torch.ones(16, 16), get_format("mxfp8"))
    with pytest.raises(ValueError, match="do not divide"):
        to_fp8(torch.ones(16, 200), get_format("fp8_e4m3@tile128"))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3@block128"])
def test_a_pair_is_the_operand_quantized_along_either_axis(name):
    """An axis-free format: the pair's second operand is the first's values quantized along
    the other axis (to_fp8 of the transpose), bit for bit; a shard's tensor amax is used."""
    fmt, x = get_format(name), _input(256, 384, torch.bfloat16)
    for amax in (None, torch.tensor(3 * x.float().abs().max().item())):
        if amax is not None and fmt.scaling.cols is not None:
            continue  # blocks: no tensor amax
        first, second = to_fp8_pair(x, fmt, amax)
        for got, ref in ((first, to_fp8(x, fmt, amax)), (second, to_fp8(x.t(), fmt, amax))):
            assert got.data.is_contiguous() and got.data.shape == ref.data.shape
            assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
            assert torch.equal(got.scale, ref.scale)


def test_a_pair_of_a_format_that_minds_the_axis_is_refused():
    with pytest.raises(ValueError, match="another quantization"):
        to_fp8_pair(torch.ones(32, 64), get_format("fp8_e4m3@row"))


def test_the_one_pass_kernel_takes_tiles_blocks_and_short_row_major_rows():
    from megatron_ext.formats.fp8 import ROW_MAX, _one_pass
    from megatron_ext.formats.triton_kernels import TILE_ELEMS

    assert ROW_MAX <= TILE_ELEMS  # a row fits one program

    x, long = torch.ones(64, 256), torch.ones(2, 2 * ROW_MAX)
    assert _one_pass(get_format("fp8_e4m3@tile128"), x.t())
    assert _one_pass(get_format("fp8_e4m3@block128"), x)
    assert _one_pass(get_format("fp8_e4m3@row"), x)
    assert not _one_pass(get_format("fp8_e4m3@row"), x.t())  # strided rows: two passes
    assert not _one_pass(get_format("fp8_e4m3@row"), long)
    assert not _one_pass(get_format("fp8_e4m3"), x)  # per tensor: a reduction first
