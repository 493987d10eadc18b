"""What a QuantizedTensor stores: codes, packing, scales in their real types, bytes, files.

Checked against hand computations, the float64 reference (``formats_reference.py``: its
grids list an element's magnitudes in code order) and torch's own float8 dtypes.
"""

import dataclasses
import io
import math

import numpy as np
import pytest
import torch
from formats_reference import block_factors, grid

from megatron_ext.formats import QuantizedTensor, dequantize, fake_quant, get_element, quantize
from megatron_ext.formats.codes import code_values, pack_nibbles, unpack_nibbles
from megatron_ext.formats.rounding import e8m0_decode, e8m0_encode

SMALL_ELEMENTS = ["fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "int8", "int4"]


def codes_of(qt: QuantizedTensor) -> torch.Tensor:
    """One code per element (unpacked)."""
    if qt.fmt.bits == 4:
        return unpack_nibbles(qt.codes, qt.shape[qt.axis])
    return qt.codes


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_pack_and_unpack_every_pair_of_nibbles():
    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="xy")
    codes = torch.stack([lo.reshape(-1), hi.reshape(-1)], 1).reshape(1, -1).to(torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 256)
    assert packed[0].tolist() == [lo_ + 16 * hi_ for hi_ in range(16) for lo_ in range(16)]
    assert torch.equal(unpack_nibbles(packed, 512), codes)


def test_an_odd_row_leaves_the_last_high_nibble_zero():
    codes = torch.tensor([[1, 2, 15], [9, 0, 7]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F], [0x09, 0x07]]
    assert torch.equal(unpack_nibbles(packed, 3), codes)


@pytest.mark.parametrize("element", SMALL_ELEMENTS)
def test_codes_are_the_index_in_the_reference_grid(element):
    """Unscaled (``@none``) grid values: magnitude code = position in the ascending grid,
    the sign bit on top (sign-magnitude for the integers)."""
    g = grid(element)
    x = torch.tensor(np.concatenate([g, -g]), dtype=torch.float32)
    codes = codes_of(quantize(x, f"{element}@none"))[0].long()
    bits = get_element(element).bits
    sign = 1 << (bits - 1)
    assert codes.tolist() == list(range(len(g))) + [sign + k for k in range(len(g))]
    values = code_values(get_element(element))
    assert values[: len(g)].tolist() == g.tolist() and values.shape == (2**bits,)
    assert all(math.isnan(v) for v in values[len(g) : sign].tolist())  # never produced


@pytest.mark.parametrize(
    "element,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]
)
def test_fp8_codes_are_torch_float8_bit_patterns(element, dtype):
    """Codes viewed as torch's float8 times the expanded block scales = fake_quant."""
    x = randn(130, 200) * 100
    qt = quantize(x, f"{element}@tile128")
    scales = qt.scales.repeat_interleave(128, dim=1)[:, :200]
    assert torch.equal(qt.codes.view(dtype).float() * scales, fake_quant(x, f"{element}@tile128"))
    table = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = table.abs() <= torch.finfo(dtype).max
    assert torch.equal(code_values(get_element(element))[finite], table[finite])


def test_a_hand_worked_mxfp4_block():
    """amax 6 -> E8M0 byte 127 + floor(log2 6) - 2 = 127 (scale 1); E2M1 codes: 6 = 0b0111,
    -3 = 0b1101, 0.5 = 0b0001 (subnormal), -0 = 0b1000, 0.2 -> 0, -0.2 -> -0."""
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([6.0, -3.0, 0.5, -0.0, 0.2, -0.2])
    qt = quantize(x, "mxfp4")
    assert qt.scales.dtype == torch.uint8 and qt.scales.tolist() == [[127]]
    assert qt.codes.shape == (1, 16) and qt.codes[0, :3].tolist() == [0xD7, 0x81, 0x80]
    assert qt.codes[0, 3:].tolist() == [0] * 13
    tiny = torch.full((1, 32), 2.0**-128)  # amax below 2**-127 * 4: the smallest scale
    qt = quantize(tiny, "mxfp4")
    assert qt.scales.tolist() == [[0]] and qt.codes[0, 0].item() == 0x11  # 0.5 = 0b0001
    assert torch.equal(dequantize(qt), tiny)
    assert torch.equal(dequantize(qt), fake_quant(tiny, "mxfp4"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_every_e8m0_byte_decodes_to_its_power_of_two(dtype):
    codes = torch.arange(255, dtype=torch.uint8)
    values = e8m0_decode(codes, dtype)
    assert values.dtype == dtype and values.tolist() == [2.0 ** (k - 127) for k in range(255)]
    assert torch.equal(e8m0_encode(values), codes)


def test_mx_scale_bytes_follow_the_ocp_rule():
    x = randn(64, 96, seed=1) * torch.exp(randn(64, 1, seed=2) * 8)
    for name, emax in [("mxfp4", 2), ("mxfp8", 8), ("mxfp6_e3m2", 4)]:
        amax = x.abs().view(64, 3, 32).amax(-1).double().numpy()
        expected = np.clip(np.floor(np.log2(amax)) - emax, -127, 127) + 127
        assert quantize(x, name).scales.tolist() == expected.tolist()


@pytest.mark.parametrize("name", ["nvfp4", "fp8_e4m3@block128", "int8@row", "fp8_e4m3"])
def test_scales_match_the_float64_reference(name):
    """The stored scales give the reference's per-block dequantization factor."""
    x = randn(130, 200, seed=3) * torch.exp(randn(130, 1, seed=4) * 3)
    qt = quantize(x, name)
    d_ref = torch.from_numpy(block_factors(x.double().numpy(), name, torch.float32)[1])
    if name == "nvfp4":
        assert qt.scales.dtype == torch.uint8 and qt.tensor_scale.dtype == torch.float32
        assert qt.tensor_scale.item() == np.float32(x.abs().max().item() / (448 * 6))
        d = (qt.scales.view(torch.float8_e4m3fn).float() * qt.tensor_scale).double()
        d = d.repeat_interleave(16, 1)
    else:
        assert qt.scales.dtype == torch.float32 and qt.tensor_scale is None
        rows, cols = qt.fmt.scaling.rows or 130, qt.fmt.scaling.cols or 200
        d = qt.scales.double().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    assert torch.equal(d[:130, :200], d_ref)


@pytest.mark.parametrize(
    "name,shape,code_bytes,scale_bytes",
    [
        ("mxfp4", (256, 256), 256 * 128, 256 * 8),  # 32768 + 2048 E8M0 bytes
        ("mxfp4+sr", (256, 256), 32768, 2048),
        ("nvfp4", (256, 256), 32768, 256 * 16 + 4),  # E4M3 per 16 + one float32
        ("mxfp6_e2m3", (256, 256), 65536, 2048),  # 6-bit codes take a byte each
        ("mxfp8", (4, 64), 256, 8),
        ("fp8_e4m3@block128", (256, 256), 65536, 4 * 4),
        ("fp8_e4m3@block128", (129, 130), 129 * 130, 4 * 4),  # partial blocks count
        ("fp8_e5m2", (10, 10), 100, 4),
        ("int8@row", (100, 50), 5000, 100 * 4),
        ("int4@tile128", (256, 255), 256 * 128, 256 * 2 * 4),  # odd rows: a padding nibble
        ("fp4_e2m1@none", (3, 4), 6, 0),
        ("bf16", (8, 8), 128, 0),
        ("fp32", (8, 8), 256, 0),
    ],
)
def test_nbytes_is_codes_plus_scales(name, shape, code_bytes, scale_bytes):
    qt = quantize(randn(*shape), name)
    assert qt.nbytes == code_bytes + scale_bytes
    x = randn(*shape)
    x[0, 0], x[1, 1] = float("nan"), float("inf")  # kept aside: int64 index + value each
    aside = 0 if name in ("bf16", "fp32") else 2 * (8 + 4)
    assert quantize(x, name).nbytes == code_bytes + scale_bytes + aside


def test_field_types():
    qt = quantize(randn(3, 5, 40).bfloat16(), "mxfp4", axis=1)
    assert (qt.shape, qt.dtype, qt.axis, qt.fmt.canonical) == (
        (3, 5, 40), torch.bfloat16, 1, "fp4_e2m1@mx32"
    )  # fmt: skip
    assert qt.codes.shape == (120, 3) and qt.scales.shape == (120, 1)
    assert qt.nonfinite_index.numel() == 0 and qt.device == torch.device("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        qt.codes = qt.codes


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4+sr", "fp8_e4m3@block128", "bf16", "int4@row"])
def test_to_dict_survives_torch_save_with_weights_only(name):
    x = randn(70, 33, seed=5)
    x[3, 4] = float("nan")
    qt = quantize(x, name, axis=0, generator=torch.Generator().manual_seed(0))
    buf = io.BytesIO()
    torch.save({"state": {"exp_avg": qt.to_dict()}}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["state"]["exp_avg"]
    back = QuantizedTensor.from_dict(loaded)
    assert back.fmt == qt.fmt and back.nbytes == qt.nbytes
    assert torch.equal(dequantize(back).view(torch.int32), dequantize(qt).view(torch.int32))


def test_fields_that_do_not_fit_are_rejected():
    d = quantize(randn(8, 64), "mxfp4").to_dict()
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedTensor.from_dict({**d, "codes": d["codes"][:, :-1]})
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedTensor.from_dict({**d, "scales": d["scales"].float()})
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedTensor.from_dict({**d, "format": "nvfp4"})  # no tensor scale, other blocks
    with pytest.raises(ValueError, match="missing key"):
        QuantizedTensor.from_dict({k: v for k, v in d.items() if k != "scales"})
    with pytest.raises(ValueError, match="bad dtype"):
        QuantizedTensor.from_dict({**d, "dtype": "int8"})
