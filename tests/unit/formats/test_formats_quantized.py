"""quantize / dequantize against fake_quant: the same values, bit for bit, for every format.

``fake_quant`` itself is checked against the float64 reference elsewhere
(``test_formats_numerics.py``); here the stored codes and scales must give back exactly
its result, NaN payloads and signed zeros included, for every registered name.
"""

import pytest
import torch

import megatron_ext.formats.pipeline as pipeline
from megatron_ext.formats import QuantizedTensor, available, dequantize, fake_quant, quantize

# (shape, axis): ragged tiles / MX / NV blocks (200 = 128 + 72 = 6.25 x 32 = 12.5 x 16),
# 1-D, 3-D along every axis, and 128x128 blocks cut in both dims (131 x 150)
CASES = [
    ((130, 200), -1),
    ((200, 130), 0),
    ((77,), 0),
    ((3, 5, 40), 0),
    ((3, 5, 40), 1),
    ((3, 5, 40), -1),
    ((131, 150), -1),
    ((150, 131), 0),
]
SR_AND_SAMPLE = ["mxfp4+sr", "nvfp4+sr", "fp4_e2m1@block128+sr", "int8@row+sr", "mxfp4", "nvfp4"]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bit pattern everywhere (NaN payloads and -0.0 included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    int_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a.view(int_dtype), b.view(int_dtype))


def sample(shape, dtype, seed: int, specials: bool) -> torch.Tensor:
    """Normal values with a log-normal scale per row (many block scales), optionally with
    zeros of both signs, huge and tiny magnitudes, float32 subnormals, NaN and ±inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = x * torch.exp(torch.randn(shape[:-1] + (1,), generator=gen, dtype=torch.float64) * 4)
    x = x.to(dtype)
    if specials:
        flat = x.view(-1)
        huge = torch.finfo(dtype).max / 4
        values = [0.0, -0.0, 1e-30, -3e-41, huge, -huge, float("nan"), float("inf"), -float("inf")]
        picks = torch.randperm(flat.numel(), generator=gen)[: len(values)]
        flat[picks] = torch.tensor(values, dtype=torch.float64).to(dtype)
        flat[-min(40, flat.numel() // 2) :] = 0.0  # an all-zero stretch: zero-amax blocks
    return x


def check_round_trip(x: torch.Tensor, name: str, axis: int, seed: int = 5) -> QuantizedTensor:
    expected = fake_quant(x, name, axis=axis, generator=torch.Generator().manual_seed(seed))
    qt = quantize(x, name, axis=axis, generator=torch.Generator().manual_seed(seed))
    got = dequantize(qt)
    assert same_bits(got, expected), (
        f"{name} {tuple(x.shape)} axis={axis} {x.dtype}: "
        f"{(got != expected).sum().item()} values differ"
    )
    assert same_bits(qt.dequantize(), expected)
    return qt


@pytest.mark.parametrize("name", available())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_of_quantize_is_fake_quant(name, dtype):
    for i, (shape, axis) in enumerate(CASES):
        for specials in (False, True):
            check_round_trip(sample(shape, dtype, seed=i, specials=specials), name, axis)


@pytest.mark.parametrize(
    "name", ["fp16", "fp8_e4m3@row", "fp4_e2m1@block128+sr", "mxfp6_e3m2", "nvfp4", "int4@tile128"]
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_other_input_dtypes(name, dtype):
    for i, (shape, axis) in enumerate(CASES[:3]):
        check_round_trip(sample(shape, dtype, seed=i, specials=True), name, axis)


@pytest.mark.parametrize("name", SR_AND_SAMPLE)
def test_many_chunks_draw_the_same_noise(name, monkeypatch):
    """Several CPU chunks (tensor and block rows cut across them), same draws as fake_quant."""
    monkeypatch.setattr(pipeline, "CHUNK_ELEMS", 1000)
    x = sample((300, 257), torch.float32, seed=9, specials=True)
    for axis in (0, 1):
        check_round_trip(x, name, axis)


def test_stochastic_rounding_follows_the_generator():
    x = sample((64, 256), torch.float32, seed=1, specials=False)
    a = quantize(x, "mxfp4+sr", generator=torch.Generator().manual_seed(1))
    b = quantize(x, "mxfp4+sr", generator=torch.Generator().manual_seed(2))
    assert not torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("name", ["mxfp4", "fp8_e4m3", "int8@row", "bf16", "fp32", "nvfp4"])
def test_empty_and_scalar_tensors(name):
    for shape in [(0, 5), (5, 0), (0,), ()]:
        x = sample(shape, torch.float32, seed=0, specials=False) if shape else torch.tensor(-0.3)
        qt = check_round_trip(x, name, axis=-1)
        assert qt.shape == tuple(shape)


def test_input_is_not_aliased_or_changed():
    x = sample((16, 64), torch.float32, seed=3, specials=True)
    before = x.clone()
    qt = quantize(x, "fp32")
    assert qt.codes.data_ptr() != x.data_ptr() and same_bits(x, before)
    y = dequantize(qt)
    assert y.data_ptr() != qt.codes.data_ptr()
    quantize(x, "mxfp4+sr")
    assert same_bits(x, before)


def test_bad_inputs():
    with pytest.raises(TypeError, match="quantize takes"):
        quantize(torch.arange(4), "mxfp4")
    with pytest.raises(IndexError):
        quantize(torch.ones(2, 2), "mxfp4", axis=2)
    with pytest.raises(ValueError, match="bad format name"):
        quantize(torch.ones(2, 2), "fp5")
