"""Block geometry of GaussWS on the FULL weight, and what one tensor-parallel shard holds.

Eq. 1 groups the weight into square ``block x block`` tiles (32 x 32, OCP MX's block) and
scales each tile's noise by the tile's max |w|. Square tiles make that max the same for the
weight and its transpose (the fprop and dgrad GEMMs see one ŵ), and the geometry is that of
the **full** M x N weight as it is laid out at TP=1: tiles at the ragged bottom/right edges
are partial (fewer rows or columns), and a TP shard may cut tiles too. Example: the tiny
Llama's fc2 is 128 x 352; at TP=2 each rank holds 176 columns = 5.5 tiles, and tile column 5
(columns 160..191) is split between the two ranks.

A shard's tile max must be the *full* tile's max, so it is a two-step computation:

1. :func:`local_block_amax` — each rank reduces |w| over its part of every tile, into a
   grid of the full tile shape (``ceil(M/block) x ceil(N/block)``), 0 for tiles it does not
   touch (0 is neutral: |w| >= 0);
2. combine — elementwise max over ranks: an all-reduce MAX over the TP group
   (:func:`all_reduce_block_amax`; :func:`combine_block_amax` is the same on a list, for
   tests). Every rank then holds the full grid, identical to TP=1's (max is exact in any
   order). The grid is 1/block^2 of the weight (1/1024: 4 bytes per 1024 weights).

:class:`ShardLayout` says which full-tensor rows and columns a local tensor holds: one
column range (row-parallel layers split the input dimension) and one or more row ranges
(column-parallel layers split the output dimension; the fused SwiGLU fc1 ``[gate; up]``
holds a slice of each half, so two ranges).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ext.errors import UsageError


@dataclass(frozen=True)
class ShardLayout:
    """Which part of a full ``full_shape`` weight a local tensor holds."""

    full_shape: tuple[int, int]
    """(M, N) of the full weight (output x input features, as at TP=1)."""
    row_ranges: tuple[tuple[int, int], ...]
    """Full-tensor row ranges ``[start, stop)`` held, concatenated in this order."""
    col_range: tuple[int, int]
    """The full-tensor column range ``[start, stop)`` held."""
    block: int = 32
    """Side of the square tiles (eq. 1's block size)."""

    def __post_init__(self):
        m, n = self.full_shape
        spans = [*self.row_ranges, self.col_range]
        limits = [m] * len(self.row_ranges) + [n]
        if self.block < 1 or not self.row_ranges:
            raise UsageError(f"bad shard layout {self}: needs a block >= 1 and a row range")
        if any(not 0 <= lo < hi <= lim for (lo, hi), lim in zip(spans, limits)):
            raise UsageError(f"bad shard layout {self}: ranges must be non-empty, in bounds")

    @classmethod
    def full(cls, rows: int, cols: int, block: int = 32) -> ShardLayout:
        """The whole weight (TP=1)."""
        return cls((rows, cols), ((0, rows),), (0, cols), block)

    @classmethod
    def tensor_parallel(cls, full_shape, tp_size: int, tp_rank: int, dim: int, parts: int = 1,
                        block: int = 32) -> ShardLayout:
        """Rank ``tp_rank``'s shard: ``dim`` 0 for column-parallel (rows split), 1 for
        row-parallel (columns split); ``parts`` > 1 splits each of that many equal parts of
        the rows separately (megatron's fused SwiGLU fc1: ``parts=2``)."""
        m, n = full_shape
        size = (m // parts if dim == 0 else n) // tp_size
        if dim not in (0, 1) or size * tp_size * (parts if dim == 0 else 1) != full_shape[dim]:
            raise UsageError(f"{full_shape} does not split evenly {tp_size} ways along {dim}")
        lo = tp_rank * size
        if dim == 1:
            return cls((m, n), ((0, m),), (lo, lo + size), block)
        ranges = tuple((p * m // parts + lo, p * m // parts + lo + size) for p in range(parts))
        return cls((m, n), ranges, (0, n), block)

    @property
    def shape(self) -> tuple[int, int]:
        """The local tensor's shape."""
        return sum(hi - lo for lo, hi in self.row_ranges), self.col_range[1] - self.col_range[0]

    @property
    def grid_shape(self) -> tuple[int, int]:
        """Tiles of the full weight: ``(ceil(M/block), ceil(N/block))``."""
        return tuple(-(-d // self.block) for d in self.full_shape)

    @property
    def is_full(self) -> bool:
        """Whether the local tensor is the whole weight in order (TP=1; fc1's two halves
        then meet)."""
        ends = [0] + [hi for _, hi in self.row_ranges]
        return (all(lo == end for (lo, _), end in zip(self.row_ranges, ends))
                and ends[-1] == self.full_shape[0] and self.col_range == (0, self.full_shape[1]))

    def global_rows(self, device=None) -> torch.Tensor:
        """Full-tensor index of each local row (int64)."""
        return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in self.row_ranges])

    def check(self, w: torch.Tensor) -> None:
        """Raise if ``w`` is not a 2-D tensor of this layout's local shape."""
        if w.ndim != 2 or tuple(w.shape) != self.shape:
            raise UsageError(f"weight of shape {tuple(w.shape)} does not match {self}")


def segment_reduce(t: torch.Tensor, dim: int, start: int, block: int, op: str):
    """Reduce ``t`` along ``dim`` over tiles, ``t``'s index 0 being full index ``start``:
    returns tiles ``start // block ..`` (partial tiles padded with 0 before reducing)."""
    before = start % block
    after = -(before + t.shape[dim]) % block
    if before or after:
        t = F.pad(t, (before, after) if dim == t.ndim - 1 else (0, 0, before, after))
    shape = list(t.shape)
    shape[dim : dim + 1] = [shape[dim] // block, block]
    t = t.reshape(shape)
    return t.amax(dim + 1) if op == "amax" else t.sum(dim + 1)


def block_reduce(t: torch.Tensor, layout: ShardLayout, op: str, col_partial=None):
    """The full tile grid of ``op`` ("amax" or "sum") over a local tensor's part of every
    tile, 0 for tiles it does not touch. ``col_partial`` may give the column-reduced
    ``rows x col-tiles`` tensor directly (the backward builds it chunk by chunk)."""
    b = layout.block
    if col_partial is None:
        col_partial = segment_reduce(t, 1, layout.col_range[0], b, op)
    if layout.is_full:  # the whole weight: its tiles are the grid
        return segment_reduce(col_partial, 0, 0, b, op)
    grid = torch.zeros(layout.grid_shape, dtype=col_partial.dtype, device=col_partial.device)
    c0 = layout.col_range[0] // b
    view = grid[:, c0 : c0 + col_partial.shape[1]]
    offset = 0
    for lo, hi in layout.row_ranges:  # one or two ranges
        part = segment_reduce(col_partial[offset : offset + hi - lo], 0, lo, b, op)
        tiles = view[lo // b : lo // b + part.shape[0]]  # two ranges may share a tile
        tiles.copy_(torch.maximum(tiles, part) if op == "amax" else tiles + part)
        offset += hi - lo
    return grid


def local_block_amax(w: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """Step 1: this shard's partial tile maxima of |w| on the full grid (float32, or
    float64 for a float64 weight)."""
    layout.check(w)
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    (m, n), b = w.shape, layout.block
    if layout.is_full and m % b == 0 and n % b == 0:  # whole tiles: one reduction, then the
        # grid's cast (exact, and max commutes with it), not a float32 copy of the weight
        return w.detach().abs().view(m // b, b, n // b, b).amax(dim=(1, 3)).to(dtype)
    return block_reduce(w.detach().abs().to(dtype), layout, "amax")


def combine_block_amax(partials: list[torch.Tensor]) -> torch.Tensor:
    """Step 2 on a list of every rank's partial grid (what the all-reduce MAX computes)."""
    return torch.stack(partials).amax(0)


def all_reduce_block_amax(partial: torch.Tensor, group=None) -> torch.Tensor:
    """Step 2 in a run: all-reduce MAX over the TP ``group`` in place (no-op at TP=1)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(partial, op=dist.ReduceOp.MAX, group=group)
    return partial
