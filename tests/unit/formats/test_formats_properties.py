"""Property tests (hypothesis): special values, ragged shapes and every input dtype."""

import math

import numpy as np
import torch
from formats_reference import fake_quant_ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_formats_numerics import assert_bits_equal

from megatron_ext.formats import fake_quant, get_format

FORMATS = [
    "fp8_e4m3", "fp8_e5m2@row", "fp8_e4m3@tile128", "fp8_e4m3@block128", "fp6_e3m2@tile32",
    "fp4_e2m1@tile128", "fp4_e2m1@block128", "mxfp8", "mxfp6_e2m3", "mxfp4", "nvfp4",
    "int8@row", "int4@tile128", "fp8_e4m3@none", "int8@none", "bf16", "fp16",
]  # fmt: skip
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -3e-39, 1e-310, 448.0, 449.0, 6.0, 7.0,
            5.0, -2.5, 0.25, 3.4e38, -1e300, 65504.0, 65520.0, 1e-8]  # fmt: skip

settings.register_profile(
    "formats", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
SETTINGS = settings.get_profile("formats")


@st.composite
def tensors(draw, max_rows=40, max_cols=200):
    """A 2-D or 3-D tensor: mostly log-uniform magnitudes, with special values sprinkled in."""
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    lead = draw(st.lists(st.integers(1, 3), max_size=1))
    shape = (*lead, draw(st.integers(1, max_rows)), draw(st.integers(1, max_cols)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, size=shape[:-1] + (1,)))
    n_special = draw(st.integers(0, 6))
    flat = x.reshape(-1)
    for _ in range(n_special):
        flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from(SPECIALS))
    return torch.from_numpy(x).to(dtype)


small_arrays = hnp.arrays(
    np.float64,
    hnp.array_shapes(min_dims=1, max_dims=2, max_side=40),
    elements=st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True, width=64),
)


@SETTINGS
@given(x=tensors(), name=st.sampled_from(FORMATS))
def test_matches_reference(x, name):
    assert_bits_equal(fake_quant(x, name), fake_quant_ref(x, name))


@SETTINGS
@given(a=small_arrays, dtype=st.sampled_from(sorted(DTYPES)), name=st.sampled_from(FORMATS))
def test_matches_reference_on_adversarial_values(a, dtype, name):
    with np.errstate(over="ignore"):
        x = torch.from_numpy(a).to(DTYPES[dtype])
    assert_bits_equal(fake_quant(x, name), fake_quant_ref(x, name))


@SETTINGS
@given(x=tensors(), name=st.sampled_from(FORMATS), axis=st.integers(-2, 1))
def test_invariants(x, name, axis):
    """Shape, dtype, NaN/inf positions and signs are kept; finite stays finite (the IEEE
    casts aside, which overflow to inf as casts do); idempotent (nvfp4 aside)."""
    y = fake_quant(x, name, axis=axis)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(torch.isnan(y), torch.isnan(x))
    assert torch.equal(y[torch.isinf(x)], x[torch.isinf(x)])
    if name not in ("bf16", "fp16"):
        assert torch.isfinite(y[torch.isfinite(x)]).all()
    keep = ~torch.isnan(x)
    assert torch.equal(torch.signbit(y[keep]), torch.signbit(x[keep]))
    if name != "nvfp4":
        assert_bits_equal(fake_quant(y, name, axis=axis), y)


@SETTINGS
@given(x=tensors(), name=st.sampled_from(["fp8_e4m3@none", "int8@none", "fp4_e2m1@none"]))
def test_unscaled_formats_saturate_at_the_element_max(x, name):
    max_ = {"fp8_e4m3@none": 448.0, "int8@none": 127.0, "fp4_e2m1@none": 6.0}[name]
    y = fake_quant(x, name)
    finite = torch.isfinite(x)
    assert (y[finite].abs() <= max_).all()
    big = finite & (x.abs() >= max_)
    assert torch.equal(y[big], torch.copysign(torch.full_like(y[big], max_), x[big]))


@SETTINGS
@given(
    x=tensors(),
    name=st.sampled_from(
        ["fp8_e4m3@tile128", "fp4_e2m1@block128", "fp6_e3m2@tile32", "fp8_e5m2", "int8@row"]
    ),
)
def test_amax_scaling_never_exceeds_the_amax_by_more_than_the_scale_rounding(x, name):
    """The block amax maps onto the element max, so nothing rounds beyond it (MX and NVFP4
    may: their scales are rounded to a power of two / to E4M3 first)."""
    y = fake_quant(x, name).double()
    finite = torch.isfinite(x)
    amax = x.double().abs().where(finite, torch.zeros((), dtype=torch.float64)).amax()
    # below amax = max * (smallest normal) the scale is clamped there and the grid is fixed
    floor = (
        get_format(name).element.max
        * torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).tiny
    )
    assert (y[finite].abs() <= torch.clamp(amax * (1 + 2**-16), min=floor)).all()
