"""Gaussian weight sampling, eq. 1-3 of the paper (§3.2), on a weight or a TP shard of one.

Forward (eq. 1), per 32 x 32 tile of the full weight with learnable bit width b_t:

    ŵ = w + R ⊙ broadcast(s),   s = max_tile |w| · 2^(1 - b_t)

R ∈ {-2..2} from :mod:`.noise` (the step's key, never stored). Backward, treating
∂max|w|/∂w as 0 (one element of 1024 — eq. 2's approximation):

    ∂L/∂w   = ∂L/∂ŵ                                             (eq. 2)
    ∂L/∂b_t = -ln 2 · s · Σ_tile (∂L/∂ŵ ⊙ R)                    (eq. 3)

R is regenerated from the key in the backward pass, and so is ŵ itself: the GEMM keeps w
and calls :func:`perturb` again for its dgrad (:func:`recomputable_sample`, the precision
platform's :class:`~megatron_ext.precision.gemm.RecomputableWeight`), so nothing of ŵ or R
outlives the forward but the tile grid of s. On CUDA a Triton kernel generates R and adds
the scaled noise in one pass, and another makes eq. 3's sums with R in registers (float32
sums in another order: equal to float32 rounding, not bit for bit); the torch path (CPU,
or float64) works in row chunks so its temporaries stay bounded, and adds with one
``addcmul``.

Under TP the caller passes the full tile grids (``amax`` combined over the group, see
:mod:`.layout`; ``bits`` replicated on every rank). A shard's eq. 3 sum covers only its part
of each tile, so with ``group`` set the backward all-reduces (SUM) the bit-width gradient over
the TP group: every rank then holds the full gradient, as at TP=1 (same value up to float
summation order), and the replicated ``bits`` parameter stays identical across ranks.

Eq. 6's underflow bound — ŵ is cast to the GEMM's format with ``m`` mantissa bits, and a
nonzero noise under half a grid step of the tile's top binade would be rounded away while
eq. 3 still credits it — caps b_t at ``m + 2 - r`` (``r = 0`` for this R: min nonzero
|R| = 2^0): :func:`underflow_bound` (BF16: 9, FP8 E4M3: 5, E5M2: 4, FP4 E2M1: 3).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from megatron_ext.errors import UsageError
from megatron_ext.formats import CastElement, FloatElement, get_format
from megatron_ext.precision.gemm import RecomputableWeight

from . import noise
from .layout import (
    ShardLayout,
    all_reduce_block_amax,
    block_reduce,
    local_block_amax,
    segment_reduce,
)

CHUNK_ELEMS = 1 << 20
"""Elements of R per chunk on the torch path (CPU: the temporaries stay bounded, in cache;
the Triton kernels keep R in registers)."""


def underflow_bound(mantissa_bits: int, r: int = 0) -> int:
    """Eq. 6: the largest b_t whose nonzero noise survives a cast to a format with
    ``mantissa_bits`` stored mantissa bits (``2^-r`` = the smallest nonzero |R|)."""
    return mantissa_bits + 2 - r


def format_mantissa_bits(name: str) -> int:
    """Stored mantissa bits of a GEMM operand format name (``"bf16"``, ``"mxfp8"``, ...)."""
    element = get_format(name).element
    if isinstance(element, FloatElement):
        return element.mbits
    if isinstance(element, CastElement):
        return round(-math.log2(torch.finfo(element.dtype).eps))  # eps = 2^-m
    raise UsageError(f"eq. 6 needs a floating-point weight format, got {name}")


def _compute_dtype(w: torch.Tensor) -> torch.dtype:
    return torch.float64 if w.dtype == torch.float64 else torch.float32


def block_scale(amax: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """s = max|w| · 2^(1 - b_t) per tile (``amax``'s dtype)."""
    return amax * torch.exp2(1 - bits.detach().to(amax.dtype))


def _triton_for(t: torch.Tensor):
    """The Triton module when ``t`` is a CUDA float32/bfloat16/float16 tensor, else None."""
    if not t.is_cuda or t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    try:
        from . import triton_kernels
    except ImportError:  # no triton: the torch path runs on CUDA too
        return None
    return triton_kernels


@functools.lru_cache(maxsize=64)
def _indices(layout: ShardLayout, device: torch.device):
    """The layout's full row indices and its columns' tile indices (cached per layout)."""
    c0, c1 = layout.col_range
    return layout.global_rows(device), torch.arange(c0, c1, device=device) // layout.block


def _noise_chunks(layout: ShardLayout, key: int, like: torch.Tensor, dtype: torch.dtype):
    """(first local row, full row indices, R) per chunk of rows on ``like``'s device: the
    torch path's R, generated a chunk at a time so its temporaries stay bounded."""
    rows = _indices(layout, like.device)[0]
    c0, c1 = layout.col_range
    step = max(1, CHUNK_ELEMS // (c1 - c0))
    for lo in range(0, len(rows), step):
        part = rows[lo : lo + step]
        yield lo, part, noise.noise_block(part, c0, c1 - c0, layout.full_shape[1], key, dtype)


def _scaled_add(w: torch.Tensor, r: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
                layout: ShardLayout, out: torch.Tensor) -> None:
    """``out = w + r · s`` for full rows ``rows`` x the layout's columns, s from the tile
    grid ``scale``: broadcast over each tile's columns when the columns are whole tiles,
    else expanded per element."""
    b, (c0, c1) = layout.block, layout.col_range
    s_rows = scale.index_select(0, rows // b)
    if c0 % b == 0 and (c1 - c0) % b == 0:
        shape = (len(rows), (c1 - c0) // b, b)
        s = s_rows[:, c0 // b : c1 // b, None]
        torch.addcmul(w.view(shape), r.view(shape), s, out=out.view(shape))
    else:
        torch.addcmul(w, r, s_rows.index_select(1, _indices(layout, scale.device)[1]), out=out)


def perturb(w: torch.Tensor, scale: torch.Tensor, layout: ShardLayout, key: int,
            keep: list | None = None):
    """Eq. 1 without autograd: ŵ (``w``'s dtype) from the local ``w``, the full tile grid
    ``scale`` of s and the step's ``key``. ŵ = w + R·s is computed in float32 (float64 for a
    float64 ``w``) and rounded once to ``w``'s dtype (R·s is exact: R ∈ {-2..2}). ``keep``,
    a list, receives the torch path's R chunks for one :func:`noise_dot` to use up."""
    layout.check(w)
    kernels = _triton_for(w)
    if kernels:
        return kernels.perturb(w, scale.float(), layout, key, _indices(layout, w.device)[0])
    dtype = _compute_dtype(w)
    scale, w = scale.to(dtype), w.contiguous()
    out = torch.empty_like(w)
    for chunk in _noise_chunks(layout, key, w, dtype):
        lo, rows, r = chunk
        part, dest = w[lo : lo + len(rows)], out[lo : lo + len(rows)]
        if dest.dtype == dtype:
            _scaled_add(part, r, scale, rows, layout, dest)
        else:
            tmp = torch.empty_like(r)
            _scaled_add(part.to(dtype), r, scale, rows, layout, tmp)
            dest.copy_(tmp)
        if keep is not None:
            keep.append(chunk)
    return out


def noise_dot(grad: torch.Tensor, layout: ShardLayout, key: int, kept: list | None = None):
    """Σ_tile (grad ⊙ R) over this shard's part of every tile, on the full grid (float32,
    float64 for float64 ``grad``), 0 for tiles the shard does not touch. ``kept``: R's
    chunks from :func:`perturb` (used up), else R is generated."""
    kernels = _triton_for(grad)
    if kernels:  # R in registers, one launch
        col_partial = kernels.noise_dot(grad, _indices(layout, grad.device)[0], layout, key)
        return block_reduce(None, layout, "sum", col_partial=col_partial)
    dtype = _compute_dtype(grad)
    if not kept or kept[0][2].dtype != dtype:
        kept = _noise_chunks(layout, key, grad, dtype)
    parts = []
    for lo, rows, r in kept:
        prod = r.mul_(grad[lo : lo + len(rows)])
        parts.append(segment_reduce(prod, 1, layout.col_range[0], layout.block, "sum"))
    col_partial = parts[0] if len(parts) == 1 else torch.cat(parts)
    return block_reduce(None, layout, "sum", col_partial=col_partial)


def bits_grad(grad: torch.Tensor, scale: torch.Tensor, layout: ShardLayout, key: int,
              group=None, kept: list | None = None) -> torch.Tensor:
    """Eq. 3: ∂L/∂b_t on the full grid from ∂L/∂ŵ of this shard; with ``group`` the shards'
    partial sums are all-reduced (SUM) so every rank returns the full gradient. ``kept``:
    see :func:`noise_dot`."""
    dot = noise_dot(grad, layout, key, kept)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(dot, group=group)
    return -math.log(2.0) * scale.to(dot.dtype) * dot


class GaussSample(torch.autograd.Function):
    """ŵ = GaussSample.apply(w, bits, amax, key, layout, group, share): eq. 1 forward, eq. 2-3
    backward. ``bits`` (b_t) and ``amax`` are full tile grids; ``amax`` gets no gradient;
    ``share`` (optional, a :class:`Rebuild`) receives s and hands eq. 3 the R of a rebuild of
    ŵ made earlier in the same backward."""

    @staticmethod
    def forward(ctx, w, bits, amax, key: int, layout: ShardLayout, group=None, share=None):
        scale = block_scale(amax.to(_compute_dtype(w)), bits)
        ctx.save_for_backward(scale)
        ctx.key, ctx.layout, ctx.group, ctx.bits_dtype = key, layout, group, bits.dtype
        ctx.share = share
        if share is not None:
            share.scale = scale
        return perturb(w, scale, layout, key)

    @staticmethod
    def backward(ctx, grad_hat):
        (scale,) = ctx.saved_tensors
        grad_bits = None
        if ctx.needs_input_grad[1]:  # R regenerated from the key (or the rebuild's), not stored
            kept = ctx.share.take() if ctx.share is not None else None
            grad_bits = bits_grad(grad_hat, scale, ctx.layout, ctx.key, ctx.group, kept)
            grad_bits = grad_bits.to(ctx.bits_dtype)
        return grad_hat, grad_bits, None, None, None, None, None


class Rebuild:
    """``Rebuild(layout, key, keep_r)(w)``: ŵ again from the local ``w``, bit for bit (the
    GEMM's backward calls it for dgrad); s comes from :class:`GaussSample`'s forward, and with
    ``keep_r`` the R it generates is kept for that backward's eq. 3 (:meth:`take`)."""

    def __init__(self, layout: ShardLayout, key: int, keep_r: bool):
        self.layout, self.key = layout, key
        self.scale = None
        self.kept = [] if keep_r else None

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return perturb(w, self.scale, self.layout, self.key, self.kept)

    def take(self) -> list | None:
        """The kept R chunks, handed over once (None when there are none)."""
        kept, self.kept = self.kept, [] if self.kept is not None else None
        return kept or None


def sample_weight(w: torch.Tensor, bits: torch.Tensor, key: int, layout: ShardLayout | None = None,
                  group=None) -> torch.Tensor:
    """ŵ for the local weight ``w``: :func:`recomputable_sample`'s value."""
    return recomputable_sample(w, bits, key, layout, group).value


def recomputable_sample(w: torch.Tensor, bits: torch.Tensor, key: int,
                        layout: ShardLayout | None = None, group=None,
                        amax: torch.Tensor | None = None) -> RecomputableWeight:
    """ŵ for the local weight ``w`` (``layout`` defaults to the whole weight): the tile
    maxima (combined over the TP ``group`` when given; ``amax`` when the caller has them),
    then :class:`GaussSample`; returned
    as a :class:`~megatron_ext.precision.gemm.RecomputableWeight`, so a quantized GEMM keeps
    ``w`` and rebuilds ŵ bit for bit in its backward (from the tile scales and the key)
    instead of keeping ŵ. The rebuild, which runs just before eq. 3 in the same backward,
    hands its R on to eq. 3 (one generation of R per backward, not two)."""
    layout = layout or ShardLayout.full(*w.shape)
    if amax is None:
        amax = all_reduce_block_amax(local_block_amax(w, layout), group)
    rebuild = Rebuild(layout, key, keep_r=bits.requires_grad)
    w_hat = GaussSample.apply(w, bits, amax, key, layout, group, rebuild)
    return RecomputableWeight(w_hat, w, rebuild)
