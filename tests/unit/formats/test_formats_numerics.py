"""The torch reference against the independent float64 re-implementation, bit for bit."""

import pytest
import torch
from formats_reference import ELEMENT_SPECS, fake_quant_ref, grid, round_to_grid

from megatron_ext.formats import fake_quant, fake_quant_2d, get_element, get_format

NEAREST_FORMATS = [
    "fp32", "bf16", "fp16",
    "fp8_e4m3", "fp8_e5m2", "fp8_e4m3@row", "fp8_e4m3@tile128", "fp8_e4m3@block128",
    "fp8_e5m2@tile128", "fp8_e5m2@block128", "fp6_e3m2@tile128", "fp6_e2m3@block128",
    "fp4_e2m1@tile128", "fp4_e2m1@block128", "fp4_e2m1@row", "fp4_e2m1@tile32",
    "mxfp8", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4",
    "int8", "int8@row", "int8@tile128", "int4@tile128", "int4@block128",
    "fp8_e4m3@none", "fp4_e2m1@none", "int8@none", "fp4_e2m1@mx16", "fp8_e4m3@block32",
]  # fmt: skip
SHAPES = [(1, 1), (3, 5), (7, 33), (16, 128), (130, 260), (2, 3, 40), (129, 17)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same shape, dtype and bit pattern (NaN payloads aside, -0.0 != +0.0)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    int_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16}[actual.element_size()]
    a, e = actual.view(int_dtype)[~nan], expected.view(int_dtype)[~nan]
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {a.numel()} differ, e.g. got {actual[~nan][bad[:3, 0]].tolist()} "
        f"want {expected[~nan][bad[:3, 0]].tolist()}"
    )


def sample(shape, dtype, seed, spread=4.0):
    """Normal values with a log-normal scale per row: exercises many block scales."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    rows = torch.exp(torch.randn(shape[:-1] + (1,), generator=gen, dtype=torch.float64) * spread)
    return (x * rows).to(dtype)


def test_reference_grids_have_the_right_sizes():
    sizes = {name: len(grid(name)) for name in ELEMENT_SPECS}
    assert sizes == {
        "fp8_e4m3": 127, "fp8_e5m2": 124, "fp6_e3m2": 32, "fp6_e2m3": 32, "fp4_e2m1": 8,
        "int8": 128, "int4": 8,
    }  # fmt: skip
    assert grid("fp4_e2m1").tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


@pytest.mark.parametrize(
    "name,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]
)
def test_reference_grid_and_element_agree_with_torch_fp8_casts(name, dtype):
    """Three ways to round to FP8 agree: torch's cast, the reference, the element type."""
    max_ = torch.finfo(dtype).max
    v = torch.cat(
        [
            sample((4096,), torch.float32, 1, spread=6.0),
            torch.tensor(grid(name), dtype=torch.float32),
        ]
    )
    mid = torch.tensor((grid(name)[1:] + grid(name)[:-1]) / 2, dtype=torch.float32)  # exact ties
    v = torch.cat([v, mid, -mid]).clamp(-max_, max_)
    cast = v.to(dtype).to(torch.float32)
    ref = torch.from_numpy(round_to_grid(v.double().numpy(), grid(name))).float()
    mine = v.clone()
    get_element(name).round_(mine)
    assert_bits_equal(ref, cast)
    assert_bits_equal(mine.copysign_(v), cast)


@pytest.mark.parametrize("name", NEAREST_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(name, dtype):
    for i, shape in enumerate(SHAPES):
        x = sample(shape, dtype, seed=i)
        assert_bits_equal(fake_quant(x, name), fake_quant_ref(x, name))


@pytest.mark.parametrize(
    "name", ["fp8_e4m3@tile128", "fp4_e2m1@block128", "mxfp4", "nvfp4", "int8@row"]
)
def test_matches_reference_along_other_axes(name):
    x = sample((6, 130, 40), torch.float32, seed=3)
    for axis in (0, 1, -1):
        assert_bits_equal(fake_quant(x, name, axis=axis), fake_quant_ref(x, name, axis=axis))
    assert_bits_equal(
        fake_quant(x, name, axis=1), fake_quant(x.transpose(1, 2), name).transpose(1, 2)
    )


@pytest.mark.parametrize(
    "name", ["fp8_e4m3@block128", "fp4_e2m1@tile128", "mxfp4", "nvfp4", "fp8_e4m3"]
)
@pytest.mark.parametrize("chunk_elems", [1, 300, 128 * 300])
def test_chunking_does_not_change_results(name, chunk_elems):
    x = sample((300, 300), torch.float32, seed=5)
    fmt = get_format(name)
    assert_bits_equal(
        fake_quant_2d(x, fmt, chunk_elems=chunk_elems), fake_quant_2d(x, fmt, chunk_elems=10**9)
    )


@pytest.mark.parametrize("name", [n for n in NEAREST_FORMATS if n != "nvfp4"])
def test_idempotent(name):
    x = sample((130, 260), torch.float32, seed=7)
    once = fake_quant(x, name)
    assert_bits_equal(fake_quant(once, name), once)


def test_nvfp4_idempotent_up_to_the_tensor_scale_rounding():
    """NVFP4's float32 tensor scale amax/2688 is not exactly recovered from the output,
    so a second pass may move values by an ulp; the FP4 codes do not change."""
    x = sample((130, 256), torch.float32, seed=7)
    once = fake_quant(x, "nvfp4")
    torch.testing.assert_close(fake_quant(once, "nvfp4"), once, rtol=2**-22, atol=0)


def test_mx_scale_is_the_ocp_floor_rule():
    """Hand-worked MXFP4 block: amax 5.5 -> floor(log2 5.5) - emax(E2M1) = 2 - 2 = 0 -> scale 1;
    ties (5, 2.5, 3.5, 0.25, 1.25, 0.75) go to the even code."""
    x = torch.tensor([[5.0, 0.3, -0.75, 2.5, 3.5, -5.5, 0.25, 1.25] + [0.0] * 24])
    y = fake_quant(x, "mxfp4")
    assert y[0, :8].tolist() == [4.0, 0.5, -1.0, 2.0, 4.0, -6.0, 0.0, 1.0]


def test_values_below_the_smallest_normal_scale_are_kept_exact():
    x = torch.tensor([[2.0**-125, 2.0**-126, 3 * 2.0**-127] + [0.0] * 29])
    assert fake_quant(x, "mxfp8")[0, :3].tolist() == x[0, :3].tolist()


def test_empty_scalar_and_dtype_errors():
    assert fake_quant(torch.empty(0, 5), "mxfp4").shape == (0, 5)
    assert fake_quant(torch.tensor(0.3), "fp8_e4m3").item() == pytest.approx(0.3, rel=2**-4)
    with pytest.raises(TypeError):
        fake_quant(torch.arange(4), "fp8_e4m3")
    with pytest.raises(IndexError):
        fake_quant(torch.ones(2, 2), "fp8_e4m3", axis=2)


def test_non_contiguous_input():
    x = sample((64, 96), torch.float32, seed=9)
    assert_bits_equal(fake_quant(x.t(), "mxfp4"), fake_quant(x.t().contiguous(), "mxfp4"))
    assert_bits_equal(
        fake_quant(x[:, ::2], "fp8_e4m3@tile128"), fake_quant_ref(x[:, ::2], "fp8_e4m3@tile128")
    )


def test_fake_quant_is_not_recorded_by_autograd():
    x = torch.randn(4, 32, requires_grad=True)
    y = fake_quant(x, "mxfp4")
    assert not y.requires_grad and y.shape == x.shape
