"""Cases for the Triton kernels on CPU under the Triton interpreter (not collected
directly: ``test_formats_triton.py`` runs this file in a fresh process with
``TRITON_INTERPRET=1``, which must be set before triton is first imported). The
interpreter runs about a millisecond per program instance, hence the small shapes.
"""

import os

import pytest
import torch
from formats_reference import fake_quant_ref
from test_formats_numerics import assert_bits_equal

from megatron_ext.formats import fake_quant_2d, get_format

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_formats_triton.py"

from megatron_ext.formats import triton_kernels as tk  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

NEAREST = [
    ("fp8_e4m3@tile128", (37, 300)), ("fp8_e5m2@tile128", (37, 300)), ("fp8_e4m3@block128", (130, 200)),
    ("fp4_e2m1@tile128", (37, 300)), ("fp4_e2m1@block128", (130, 200)), ("mxfp4", (37, 300)),
    ("mxfp8", (37, 300)), ("mxfp6_e3m2", (37, 100)), ("nvfp4", (37, 300)), ("int8@tile128", (37, 300)),
    ("int4@block32", (40, 70)), ("fp8_e4m3", (37, 300)), ("fp8_e4m3", (16, 192)), ("fp4_e2m1", (37, 300)),
    ("int8", (37, 300)), ("fp8_e4m3@row", (37, 300)), ("int8@row", (300, 64)), ("int4@row", (5, 2100)),
    ("int8@row", (5, 16500)),  # longer than ROW_FUSED_MAX: the two-pass plan
    ("fp8_e4m3@block64", (130, 200)), ("fp4_e2m1@block256", (260, 300)),
]  # fmt: skip


def special_input(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen) * 3)
    x[0, :40] = 0.0
    x[0, 3] = -0.0
    x[1, 1] = float("nan")
    x[2, 2] = float("-inf")
    x[3, 3] = -1e-30
    x[4, 4] = 3e-39  # subnormal
    return x.to(dtype)


@pytest.mark.parametrize("name,shape", NEAREST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_matches_reference_bit_for_bit(name, shape, dtype):
    fmt = get_format(name)
    x = special_input(shape, dtype)
    assert tk.supports(fmt, x)
    assert_bits_equal(tk.fake_quant_2d(x, fmt), fake_quant_2d(x, fmt))


def _plans(name: str, widths) -> list[str]:
    """The launch plan ``fake_quant_2d`` takes for one row of each width."""
    calls, fused, two_pass = [], tk._fused, tk._two_pass
    tk._fused = lambda *a: calls.append("fused") or fused(*a)
    tk._two_pass = lambda *a: calls.append("two-pass") or two_pass(*a)
    try:
        for cols in widths:
            tk.fake_quant_2d(torch.ones(1, cols), get_format(name), torch.Generator())
    finally:
        tk._fused, tk._two_pass = fused, two_pass
    return calls


def test_per_row_takes_one_pass_up_to_its_limit():
    """Rows up to ROW_FUSED_MAX (padded) in the fused kernel, longer ones in two passes; half
    that length with stochastic rounding."""
    limit = tk.ROW_FUSED_MAX
    assert _plans("int8@row", (300, limit, limit + 1)) == ["fused", "fused", "two-pass"]
    assert _plans("int8@row+sr", (limit // 2, limit // 2 + 1)) == ["fused", "two-pass"]


@pytest.mark.parametrize("name", ["int8@row", "int8@row+sr", "fp8_e4m3@row"])
def test_per_row_one_pass_equals_two_pass(name):
    """Both plans give the same bits, stochastic draws included (keyed by element index)."""
    fmt, x = get_format(name), special_input((9, 300), torch.bfloat16)
    one = tk._fused(x, fmt, torch.Generator().manual_seed(5), None, 512)
    two = tk._two_pass(x, fmt, torch.Generator().manual_seed(5), None)
    assert_bits_equal(one, two)


def test_kernel_float16():
    x = special_input((37, 300), torch.float16)
    for name in ("mxfp4", "fp8_e4m3@tile128"):
        assert_bits_equal(tk.fake_quant_2d(x, get_format(name)), fake_quant_2d(x, get_format(name)))


@pytest.mark.parametrize(
    "name,dtype",
    [("fp8_e4m3@none", torch.float32), ("bf16", torch.float32), ("fp8_e4m3@tile512", torch.float32),
     ("fp8_e4m3@tile100", torch.float32), ("fp8_e4m3@block96", torch.float32), ("mxfp4", torch.float64)],
)  # fmt: skip
def test_unsupported_cases_fall_back(name, dtype):
    assert not tk.supports(get_format(name), torch.zeros(2, 2, dtype=dtype))


@pytest.mark.parametrize(
    "name", ["fp4_e2m1@tile128+sr", "mxfp4+sr", "nvfp4+sr", "int4@tile128+sr", "fp4_e2m1+sr", "int4@row+sr"]
)
def test_stochastic_kernel_has_the_reference_distribution(name):
    """Same neighbours, unbiased, and per element the same rounding-up frequency as the
    torch reference (two independent samples of n draws: |p1 - p2| <= 5 sqrt(2 p (1-p) / n))."""
    n = 256
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 128, generator=gen) * 2).expand(n, -1).contiguous()
    fmt, nearest = get_format(name), name.removesuffix("+sr")
    down, up = (
        fake_quant_ref(x[:1], nearest, mode="down")[0],
        fake_quant_ref(x[:1], nearest, mode="up")[0],
    )
    ours = tk.fake_quant_2d(x, fmt, torch.Generator().manual_seed(1))
    ref = fake_quant_2d(x, fmt, torch.Generator().manual_seed(1))
    assert ((ours == down) | (ours == up)).all()
    keep = up > down
    p_ours = (ours == up).double().mean(0)[keep]
    p_ref = (ref == up).double().mean(0)[keep]
    frac = ((x[0] - down) / (up - down)).double()[keep]  # exact up-probability
    bound = 5 * (2 * frac * (1 - frac) / n).sqrt() + 1e-9
    assert ((p_ours - p_ref).abs() <= bound).all()
    assert ((p_ours - frac).abs() <= bound).all()
    assert abs((p_ours - frac).sum()) <= 5 * (frac * (1 - frac) / n).sum().sqrt()


def test_stochastic_kernel_is_reproducible_per_seed():
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(2))
    fmt = get_format("mxfp4+sr")
    a = tk.fake_quant_2d(x, fmt, torch.Generator().manual_seed(5))
    b = tk.fake_quant_2d(x, fmt, torch.Generator().manual_seed(5))
    c = tk.fake_quant_2d(x, fmt, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_nvfp4_kernel_takes_a_given_tensor_amax():
    """A TP shard's NVFP4 second-level scale from the whole tensor's amax, as in torch."""
    fmt, x = get_format("nvfp4"), special_input((37, 300), torch.float32)
    amax = torch.tensor(1e4)  # larger than x's own: another second-level scale
    ref = fake_quant_2d(x, fmt, tensor_amax=amax)
    assert_bits_equal(tk.fake_quant_2d(x, fmt, tensor_amax=amax), ref)
    assert not torch.equal(ref.nan_to_num(), fake_quant_2d(x, fmt).nan_to_num())


@pytest.mark.parametrize("name,transposed", [("fp8_e4m3@tile128", False), ("fp8_e4m3@block128", True),
                                             ("fp8_e5m2@row", True), ("fp8_e4m3", False)])
def test_fp8_scale_and_cast_kernel_equals_the_torch_path(name, transposed):
    from megatron_ext.formats import fp8, triton_fp8

    fmt = get_format(name)
    x = special_input((128, 256), torch.bfloat16)[:, :]
    x[1, 1] = 1.0
    x[2, 2] = -2.0  # finite: to_fp8's amax is not finite-filtered
    operand = x.t().contiguous().t() if transposed else x
    ref = fp8.to_fp8(operand, fmt)  # CPU tensors: the torch path
    br, bc = fp8.block_shape(fmt, *x.shape)
    amax = fp8._block_amax(operand, br, bc)
    data, scale = triton_fp8.scale_and_cast(operand, amax, br, bc, fmt.element, ref.data.dtype)
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(scale, ref.scale)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(128, 256), (48, 80)])
def test_fp8_scale_and_cast_writes_the_transpose_in_the_same_pass(transposed, shape):
    """Per tensor: the values quantized along the other axis are these, transposed."""
    from megatron_ext.formats import fp8, triton_fp8

    fmt = get_format("fp8_e4m3")
    x = special_input(shape, torch.bfloat16)
    x[1, 1], x[2, 2] = 1.0, -2.0  # finite: to_fp8's amax is not finite-filtered
    operand = x.t().contiguous().t() if transposed else x
    ref = fp8.to_fp8(operand.t(), fmt)  # the torch path, along the other axis
    amax = fp8._block_amax(operand, *shape)
    data, scale, data_t = triton_fp8.scale_and_cast(operand, amax, *shape, fmt.element,
                                                    ref.data.dtype, with_transpose=True)
    assert torch.equal(data_t.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(data.view(torch.uint8), ref.data.t().view(torch.uint8))
    assert torch.equal(scale, ref.scale)


@pytest.mark.parametrize("name,transposed,shape", [
    ("fp8_e4m3@tile128", False, (256, 256)), ("fp8_e5m2@tile128", True, (256, 256)),
    ("fp8_e4m3@block128", False, (256, 256)), ("fp8_e4m3@block128", True, (256, 256)),
    ("fp8_e4m3@row", False, (256, 256)), ("fp8_e5m2@row", False, (37, 300))])
def test_fp8_one_pass_block_kernel_equals_the_torch_path(name, transposed, shape):
    from megatron_ext.formats import fp8, triton_fp8

    fmt = get_format(name)
    x = special_input(shape, torch.float32)
    x[1, 1], x[2, 2] = 1.0, -2.0  # finite (the reduction path's amax is not finite-filtered)
    operand = x.t().contiguous().t() if transposed else x
    ref = fp8.to_fp8(operand, fmt)  # CPU tensors: the torch path
    data, scale = triton_fp8.quantize_blocks(operand, fmt, ref.data.dtype)
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(scale, ref.scale)


def test_per_tensor_kernel_takes_a_given_tensor_amax():
    """A TP shard of a per-tensor format scaled as the whole tensor, as in torch."""
    fmt, x = get_format("fp8_e4m3"), special_input((37, 300), torch.float32)
    amax = torch.tensor(1e4)
    ref = fake_quant_2d(x, fmt, tensor_amax=amax)
    assert_bits_equal(tk.fake_quant_2d(x, fmt, tensor_amax=amax), ref)
    assert not torch.equal(ref.nan_to_num(), fake_quant_2d(x, fmt).nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_amax_kernel_matches_torch(dtype):
    """Per tensor, per row and per 32x32 block, NaN and inf left out (float64 reference)."""
    x = special_input((70, 100), dtype)
    a = x.double().abs().nan_to_num(0.0, 0.0, 0.0)
    assert tk.tensor_amax(x).item() == a.max().item()
    assert torch.equal(tk.block_amax(x, 1, 100).double(), a.amax(1, keepdim=True))
    padded = torch.nn.functional.pad(a, (0, 28, 0, 26)).view(3, 32, 4, 32)
    assert torch.equal(tk.block_amax(x, 32, 32).double(), padded.amax((1, 3)))


@pytest.mark.parametrize("n", [1, 4096, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_error_sums_kernel_equals_the_float64_reference(n, dtype):
    """Underflow count exact, the float64 sums up to their order of addition."""
    from megatron_ext.formats.error import reference_error_sums
    from megatron_ext.formats.triton_error import error_sums_1d

    x = special_input((5, 1000), dtype).view(-1)[:n].contiguous()
    x = torch.where(x.isfinite(), x, torch.zeros((), dtype=dtype))
    q = fake_quant_2d(x.view(1, -1), get_format("int4@tile128")).view(-1)
    ours, ref = error_sums_1d(x, q), reference_error_sums(x, q)
    assert ours[0] == ref[0] and (n == 1 or ref[0] > 0 or dtype == torch.bfloat16)
    torch.testing.assert_close(ours[1:], ref[1:], rtol=1e-13, atol=0)
    nan = x.clone()
    nan[0] = float("nan")
    assert error_sums_1d(nan, q)[1:].isnan().all()


def test_error_sums_pairs_transposed_views_on_the_kernel_path():
    from megatron_ext.formats.error import _paired_flat, reference_error_sums
    from megatron_ext.formats.triton_error import error_sums_1d

    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(3))
    q = fake_quant_2d(x, get_format("int4@tile128"))
    for t, u in ((x.t(), q.t()), (x.t(), q.t().contiguous()), (x, q)):
        ref = reference_error_sums(t, u)
        torch.testing.assert_close(error_sums_1d(*_paired_flat(t, u)), ref, rtol=1e-13, atol=0)


@triton.jit
def _noise_probe(out_ptr, n_cols, seed, BLOCK_K: tl.constexpr):
    rows = tl.arange(0, 4)
    col0 = tl.program_id(0) * BLOCK_K
    cols = col0 + tl.arange(0, BLOCK_K)
    noise = tk._uniform_noise(seed, rows, col0, n_cols, 4, BLOCK_K, 24)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], noise, mask=cols[None, :] < n_cols)


def test_stochastic_draws_do_not_depend_on_the_tile_width():
    """One Philox call per four columns (16-wide tiles) gives each element the draw the
    per-column path (2-wide tiles) gives it; the four words of a call all differ."""
    draws = {}
    for width in (16, 2):
        out = torch.full((4, 40), -1.0)
        _noise_probe[(triton.cdiv(40, width),)](out, 40, 1234, BLOCK_K=width)
        draws[width] = out
    assert torch.equal(draws[16], draws[2]) and ((draws[16] >= 0) & (draws[16] < 1)).all()
    quads = draws[16].view(4, 10, 4)
    assert (quads[..., :, None] != quads[..., None, :]).sum() == 4 * 10 * 12
