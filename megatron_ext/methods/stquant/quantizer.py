"""Blockwise quantization of AdamW's moments: linear for ``m``, logarithmic for ``v`` (STQuant §3.5).

A moment of one parameter shard is a 1-D float32 tensor. It is cut into blocks of ``B``
consecutive elements and every block gets its own scale, so an outlier only coarsens its own
block. Blocks follow a grid fixed in the *parameter's* flat index space, not the shard's: with
megatron's distributed optimizer a rank holds elements ``[s, e)`` of a parameter, and its
first block starts ``lead = s mod B`` elements before ``s`` (the missing elements count as
zeros, which change no block maximum). A block therefore never straddles a shard boundary,
and whenever the boundaries fall on the grid (always for one data-parallel rank, and for
DP = 2 or odd DP with ``B = 64``: megatron starts parameters on multiples of 64 and pads
buckets to ``lcm(DP, 128)``) every layout quantizes exactly the same blocks.

**Linear, for m** (signed, symmetric, ``b`` bits): ``Q = 2**(b-1) - 1``, per block
``s = amax / Q`` and ``q = round(m / s)`` in ``[-Q, Q]`` (nearest, ties to even);
``m̂ = q s``. At 4 and 8 bits this is the formats package's real quantized tensor of
``int4@row`` / ``int8@row`` over the ``(blocks, B)`` view (sign-magnitude codes, 4-bit ones
two per byte; ``s`` with its low significand bits cleared so that ``Q s`` is exact, which
makes requantizing idempotent); at 16 bits, which formats has no element for, the same rule
with ``int16`` codes. Error bound per element: ``|m - m̂| <= s / 2 = amax / (2Q)`` (1/14 of
the block's largest magnitude at 4 bits, 1/254 at 8, 1/65534 at 16). Zero is a code, so
``m = 0`` comes back exactly 0.

**Logarithmic, for v** (``v >= 0``, ``b`` bits): ``K = 2**b - 1``, per block ``vmax``; code
``0`` is exactly zero, and codes ``k = 1..K`` are ``v̂ = vmax * 2**((k - K) δ)``, a geometric
ladder with step ``δ`` (in log2 units, :data:`LOG_STEP`) ending exactly at ``vmax``. A
positive ``v`` gets ``k = clamp(round(K + log2(v / vmax) / δ), 1, K)``, computed exactly
(no ``log2``, no ``exp2``, so every device gives the same codes and values): with
``r = v / vmax = 2**e * f`` (``f`` in ``[1, 2)``), ``k = K + e/δ + #{i: f >= c_i}`` where
``c_i`` is the smallest float32 above ``2**((i + 1/2) δ)`` (:func:`log_tables`), and a code
decodes to ``vmax * rung[k]``, ``rung[k]`` the float32 nearest ``2**((k - K) δ)``. Inside the ladder's
range the relative error is bounded: ``|log2(v̂ / v)| <= δ / 2``; a ``v`` below the lowest
rung ``vmax * 2**((1 - K) δ)`` is rounded *up* to it — never down to zero, so Adam's step
``m / (sqrt(v̂) + eps)`` can only shrink, never blow up, from a too-small ``v``. ``v = 0``
(a coordinate that never saw a gradient) stays exactly 0, so with ``m = 0`` it never moves.
The squared gradients' dynamic range is why ``v`` is logarithmic: a linear 4-bit ``v`` would
send every element below ``vmax / 30`` to zero. The codes ``k`` are stored as unsigned
integers: two per byte at 4 bits (the formats package's nibble packing, low nibble first),
``uint8`` at 8, ``int16`` holding ``k - 2**15`` at 16.

**32 bits** keeps the float32 tensor itself (no codes, no scales).

Scales are float32, one per block: ``32 / B`` extra bits per element (0.5 at ``B = 64``).
Quantization is deterministic and idempotent: quantizing a dequantized state with the same
width, block and lead gives the same codes back (checkpoints and resume rely on it).
Inputs must be finite (megatron skips optimizer steps with non-finite gradients).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from megatron_ext.formats import quantize as formats_quantize
from megatron_ext.formats.codes import pack_nibbles, unpack_nibbles

BITS = (4, 8, 16, 32)
"""The widths a layer's state can have (the paper's ``B``)."""

LOG_STEP = {4: 1.0, 8: 1.0 / 8, 16: 1.0 / 2048}
"""``δ_b`` of the logarithmic ladder, in log2 units. The ladder spans ``(K - 1) δ`` octaves
below the block maximum: 14 at 4 bits (``sqrt(v)`` over a factor 128, relative error of
``v`` <= 2**0.5 - 1 = 41 %, of ``sqrt(v)`` <= 19 %), 31.75 at 8 bits (error of ``v``
<= 4.4 %), 32 at 16 bits (<= 0.017 %)."""

MODES = ("linear", "log")


@dataclass
class QState:
    """One moment of one parameter shard, as it is stored."""

    mode: str
    """``"linear"`` (first moment) or ``"log"`` (second moment)."""
    bits: int
    """Width: 4, 8, 16 (codes + scales) or 32 (the float32 values)."""
    numel: int
    """Elements of the shard it represents."""
    lead: int
    """Offset of the shard's first element inside its block (shard start mod ``block``)."""
    block: int
    """Block size ``B``."""
    codes: torch.Tensor
    """Codes of all blocks touched, ``(blocks, B)`` or ``(blocks, B / 2)`` at 4 bits (module
    docstring); the flat float32 values at 32 bits."""
    scales: torch.Tensor | None
    """float32 ``(blocks, 1)``: ``s`` (linear) or ``vmax`` (log); None at 32 bits."""

    def nbytes(self) -> int:
        """Bytes of storage: codes plus scales."""
        size = self.codes.numel() * self.codes.element_size()
        return size + (0 if self.scales is None else self.scales.numel() * 4)

    def to_dict(self) -> dict:
        """Plain form for checkpoints (tensors, ints, a string)."""
        return {"mode": self.mode, "bits": self.bits, "numel": self.numel, "lead": self.lead,
                "block": self.block, "codes": self.codes, "scales": self.scales}

    @staticmethod
    def from_dict(saved: dict) -> "QState":
        return QState(**saved)


def empty_state(like: QState, mode: str, bits: int, nblocks: int) -> QState:
    """An unfilled QState of ``like``'s shard (``nblocks`` blocks) at ``bits`` bits, for a
    fused step to write."""
    dev, block = like.codes.device, like.block
    if bits == 32:
        codes, scales = torch.empty(like.numel, dtype=torch.float32, device=dev), None
    else:
        width = block // 2 if bits == 4 else block
        dtype = torch.int16 if bits == 16 else torch.uint8
        codes = torch.empty(nblocks, width, dtype=dtype, device=dev)
        scales = torch.empty(nblocks, 1, dtype=torch.float32, device=dev)
    return QState(mode, bits, like.numel, like.lead, block, codes, scales)


def _blocks(x: torch.Tensor, block: int, lead: int) -> torch.Tensor:
    """``x`` placed at ``lead`` in a zero-padded ``(nblocks, block)`` float32 view."""
    nblocks = math.ceil((lead + x.numel()) / block)
    padded = torch.zeros(nblocks * block, dtype=torch.float32, device=x.device)
    padded[lead:lead + x.numel()] = x
    return padded.view(nblocks, block)


def _int_format(bits: int) -> str:
    return f"int{bits}@row"


def _linear(blocks: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    if bits != 16:
        qt = formats_quantize(blocks, _int_format(bits))
        return qt.codes, qt.scales
    top = 2 ** 15 - 1
    scales = blocks.abs().amax(dim=1, keepdim=True) / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(blocks / safe).clamp_(-top, top).to(torch.int16), scales


def _linear_values(q: QState) -> torch.Tensor:
    """``q``'s values in blocks: ``code * s`` at 16 bits; at 4 / 8 bits what the formats
    package's ``dequantize`` gives (``±|q| * d`` from sign-magnitude codes, a negative zero
    code as ``-0``), computed with arithmetic instead of its table lookup."""
    if q.bits == 16:
        return q.codes.float() * q.scales
    codes = unpack_nibbles(q.codes, q.block) if q.bits == 4 else q.codes
    values = (codes & ((1 << (q.bits - 1)) - 1)).float().mul_(q.scales)
    return values.mul_((codes >> (q.bits - 1)).float().mul_(-2).add_(1))


@functools.cache
def log_tables(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rungs, cuts)`` of the ``bits``-bit logarithmic ladder, float32 on ``device``:
    ``rungs[k]`` the float32 nearest ``2**((k - K) δ)`` (``rungs[0] = 0``), ``K + 1`` values;
    ``cuts[i]`` the smallest float32 above ``2**((i + 1/2) δ)``, ``1/δ`` values in ``(1, 2)``:
    a mantissa ``f`` rounds up past ``i`` rungs of its octave iff ``f >= cuts[i]`` (no float32
    equals an irrational cut, so the rounding has no ties)."""
    top, step = 2 ** bits - 1, LOG_STEP[bits]
    rungs = torch.exp2((torch.arange(top + 1, dtype=torch.float64) - top) * step).float()
    rungs[0] = 0.0
    exact = torch.exp2((torch.arange(round(1 / step), dtype=torch.float64) + 0.5) * step)
    cuts = exact.float()
    cuts = torch.where(cuts.double() < exact, torch.nextafter(cuts, torch.tensor(2.0)), cuts)
    return rungs.to(device), cuts.to(device)


def _log(blocks: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = 2 ** bits - 1
    _, cuts = log_tables(bits, blocks.device)
    vmax = blocks.amax(dim=1, keepdim=True)
    safe = torch.where(vmax > 0, vmax, torch.ones_like(vmax))
    ratio = (blocks / safe).clamp_(min=torch.finfo(torch.float32).tiny).view(torch.int32)
    k = _rungs_in_octave(ratio, cuts)
    k += ((ratio >> 23).float().sub_(127).mul_(cuts.numel()).add_(top))
    k = k.clamp_(1, top).mul_(torch.sign(blocks).clamp_(min=0))  # v <= 0: code 0
    if bits == 16:
        return (k - 2 ** 15).to(torch.int16), vmax
    return (pack_nibbles(k.to(torch.uint8)) if bits == 4 else k.to(torch.uint8)), vmax


NEAR_CUT = 2.0 ** -8
"""How close (in rungs) ``log2(f) / δ + 1/2`` must come to an integer for :func:`_rungs_in_octave`
to check it against the cuts (float32 ``log2`` and the scaling are off by < 2**-10 rungs)."""


def _rungs_in_octave(ratio_bits: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
    """``#{i: f >= cuts[i]}`` as float32, ``f`` the mantissa in ``[1, 2)`` of each (positive,
    normal) float32 whose bits are ``ratio_bits``: ``floor(log2(f) / δ + 1/2)``, and where
    that is within :data:`NEAR_CUT` of a cut, the exact count (:func:`_rungs_up`)."""
    mantissa = (ratio_bits & 0x7FFFFF).bitwise_or_(0x3F800000).view(torch.float32)
    if cuts.numel() == 1:  # one rung per octave: a single comparison is cheaper
        return (mantissa >= cuts).float()
    t = torch.log2(mantissa).mul_(cuts.numel()).add_(0.5)
    frac = torch.frac(t)
    near = (frac - 0.5).abs_() > 0.5 - NEAR_CUT
    count = t.sub_(frac)
    where = near.nonzero(as_tuple=True)
    count[where] = _rungs_up(mantissa[where], cuts).float()
    return count


def _rungs_up(mantissa: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
    """``#{i: mantissa >= cuts[i]}`` (int32): ``round(log2(mantissa) / δ)`` estimated with
    ``log2`` (off by at most one) and corrected against the cuts on either side."""
    per = cuts.numel()
    edges = torch.cat([cuts.new_full((1,), -math.inf), cuts, cuts.new_full((1,), math.inf)])
    c = torch.log2(mantissa).mul_(per).add_(0.5).floor_().clamp_(0, per).long()
    up = torch.take(edges, c + 1) <= mantissa
    down = torch.take(edges, c) > mantissa
    return c.add_(up).sub_(down.long()).int()


def _log_values(q: QState) -> torch.Tensor:
    if q.bits == 16:
        k = q.codes.to(torch.int32) + 2 ** 15
    else:
        k = unpack_nibbles(q.codes, q.block) if q.bits == 4 else q.codes
    rungs, _ = log_tables(q.bits, q.codes.device)
    return q.scales * torch.index_select(rungs, 0, k.reshape(-1).int()).view(k.shape)


@torch.no_grad()
def quantize(x: torch.Tensor, mode: str, bits: int, block: int, lead: int = 0) -> QState:
    """Quantize the 1-D float tensor ``x`` (a shard starting ``lead`` elements into a block)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if not 0 <= lead < block or block % 2:
        raise ValueError(f"need 0 <= lead < block and an even block, got {lead}, {block}")
    x = x.reshape(-1)
    if bits == 32:
        return QState(mode, 32, x.numel(), lead, block, x.float().clone(), None)
    return quantize_blocks(_blocks(x, block, lead), mode, bits, x.numel(), lead)


def quantize_blocks(blocks: torch.Tensor, mode: str, bits: int, numel: int, lead: int) -> QState:
    """:func:`quantize` of the ``numel`` values at ``lead`` in the zero-padded float32
    ``(nblocks, block)`` tensor ``blocks`` (its other elements must be zeros)."""
    if bits == 32:
        values = blocks.view(-1)[lead:lead + numel]
        return QState(mode, 32, numel, lead, blocks.shape[1],
                      values if values.numel() == blocks.numel() else values.clone(), None)
    codes, scales = (_linear if mode == "linear" else _log)(blocks, bits)
    return QState(mode, bits, numel, lead, blocks.shape[1], codes, scales)


@torch.no_grad()
def dequantize(q: QState) -> torch.Tensor:
    """The float32 values ``q`` stands for (a new 1-D tensor of ``q.numel`` elements)."""
    if q.bits == 32:
        return q.codes.clone()
    return dequantize_blocks(q).reshape(-1)[q.lead:q.lead + q.numel].clone()


def dequantize_blocks(q: QState) -> torch.Tensor:
    """The values of ``q`` in a new zero-padded float32 ``(nblocks, block)`` tensor (the
    layout :func:`quantize_blocks` takes)."""
    if q.bits == 32:
        return _blocks(q.codes, q.block, q.lead)
    return _linear_values(q) if q.mode == "linear" else _log_values(q)
