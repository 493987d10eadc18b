"""Tile geometry on the full weight: shard layouts, partial tile maxima and their combine,
checked against a brute-force loop over tiles of the full tensor."""

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.methods.gaussws.layout import (
    ShardLayout,
    block_reduce,
    combine_block_amax,
    local_block_amax,
)


def _brute_force_tiles(full: torch.Tensor, block: int, op) -> torch.Tensor:
    m, n = full.shape
    grid = torch.zeros(-(-m // block), -(-n // block), dtype=torch.float64)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = op(full[i * block : (i + 1) * block, j * block : (j + 1) * block])
    return grid


def _local(full: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    c0, c1 = layout.col_range
    return torch.cat([full[lo:hi, c0:c1] for lo, hi in layout.row_ranges])


# (full shape, TP size, split dim, parts): tiny Llama fc2 (128 x 352, 5.5 tiles per rank at
# TP=2), proj, fused SwiGLU fc1 (gate; up, 704 x 128), ragged shapes
SHARDINGS = [
    ((128, 352), 2, 1, 1), ((128, 128), 2, 1, 1), ((704, 128), 2, 0, 2), ((384, 128), 2, 0, 1),
    ((100, 70), 2, 1, 1), ((100, 70), 2, 0, 1), ((120, 50), 4, 0, 2), ((40, 99), 3, 1, 1),
    ((704, 128), 1, 0, 2), ((100, 70), 1, 0, 2),  # TP=1 SwiGLU: two meeting halves
]  # fmt: skip


@pytest.mark.parametrize("shape,tp,dim,parts", SHARDINGS)
def test_combined_partial_maxima_equal_the_full_tiles(shape, tp, dim, parts):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    layouts = [ShardLayout.tensor_parallel(shape, tp, r, dim, parts) for r in range(tp)]
    assert sum(lay.shape[dim] for lay in layouts) == shape[dim]
    partials = [local_block_amax(_local(full, lay), lay) for lay in layouts]
    expected = _brute_force_tiles(full, 32, lambda t: t.abs().max())
    sums = [block_reduce(_local(full, lay), lay, "sum") for lay in layouts]
    assert (sum(sums) - _brute_force_tiles(full, 32, torch.sum)).abs().max() <= 1e-12
    assert torch.equal(combine_block_amax(partials), expected)
    assert torch.equal(local_block_amax(full, ShardLayout.full(*shape)), expected)
    if tp > 1:  # a lone shard sees only part of the grid
        assert not torch.equal(partials[0], expected)


def test_tiny_fc2_shard_cuts_tile_five():
    lay0, lay1 = (ShardLayout.tensor_parallel((128, 352), 2, r, dim=1) for r in range(2))
    assert lay0.col_range == (0, 176) and lay1.col_range == (176, 352)
    full = torch.zeros(128, 352)
    full[3, 170] = 5.0  # rank 0's half of tile column 5
    full[40, 180] = -7.0  # rank 1's half of tile column 5
    p0, p1 = local_block_amax(full[:, :176], lay0), local_block_amax(full[:, 176:], lay1)
    assert (p0[0, 5].item(), p1[1, 5].item()) == (5.0, 7.0)
    both = combine_block_amax([p0, p1])
    assert (both[0, 5].item(), both[1, 5].item()) == (5.0, 7.0)


def test_block_sums_match_brute_force_on_a_swiglu_shard():
    full = torch.randn(200, 90, dtype=torch.float64)
    lay = ShardLayout((200, 90), ((10, 50), (110, 150)), (7, 61), block=16)
    grid = block_reduce(_local(full, lay), lay, "sum")
    masked = torch.zeros_like(full)
    for lo, hi in lay.row_ranges:
        masked[lo:hi, 7:61] = full[lo:hi, 7:61]
    assert (grid - _brute_force_tiles(masked, 16, torch.sum)).abs().max() <= 1e-12


def test_tile_maxima_commute_with_transpose():
    w = torch.randn(100, 70)
    grid = local_block_amax(w, ShardLayout.full(100, 70))
    assert torch.equal(local_block_amax(w.t(), ShardLayout.full(70, 100)), grid.t())


@pytest.mark.parametrize(
    "make",
    [lambda: ShardLayout((10, 10), ((0, 11),), (0, 10)), lambda: ShardLayout((10, 10), (), (0, 10)),
     lambda: ShardLayout((10, 10), ((0, 10),), (5, 5)), lambda: ShardLayout.full(4, 4, block=0),
     lambda: ShardLayout.tensor_parallel((10, 10), 3, 0, dim=1),
     lambda: ShardLayout.tensor_parallel((10, 12), 2, 0, dim=0, parts=4)],
)  # fmt: skip
def test_bad_layouts_are_usage_errors(make):
    with pytest.raises(UsageError):
        make()


def test_weight_of_the_wrong_shape_is_refused():
    with pytest.raises(UsageError, match="does not match"):
        local_block_amax(torch.zeros(4, 5), ShardLayout.full(5, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_whole_tile_maxima_reduce_before_the_cast(dtype):
    w = (torch.randn(96, 64, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    w[5, 7], w[40, 40] = float("-inf"), float("nan")
    layout = ShardLayout.full(96, 64)
    expected = block_reduce(w.abs().float(), layout, "amax")  # the general path
    got = local_block_amax(w, layout)
    assert got.dtype == torch.float32 and torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num()) and got[0, 0] == float("inf")
