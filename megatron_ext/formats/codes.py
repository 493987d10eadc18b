"""Element codes: the bits one quantized value is stored in, and 4-bit packing.

A code is a sign bit on top of a magnitude code (:meth:`.ElementType.magnitude_codes`):

* small floats ``E<e>M<m>``: ``sign | exponent field | mantissa field`` with the exponent
  biased by ``2**(e-1) - 1`` and field 0 for the subnormals — the OCP bit pattern, so an
  FP8 code byte viewed as ``torch.float8_e4m3fn`` / ``float8_e5m2`` is the value itself;
* integers: ``sign | |q|``, sign-magnitude. The symmetric range ``±(2**(b-1) - 1)`` fits
  exactly and a rounded-to-zero negative value keeps its ``-0``, as ``fake_quant`` does
  (two's complement would lose it).

Codes live in ``uint8``: 8-bit and 6-bit elements one per byte, 4-bit elements two per
byte along the row (``byte = even_column | odd_column << 4``, the low nibble first, as
NVIDIA's and torchao's FP4 layouts; an odd row length leaves the last high nibble 0).

Decoding looks bytes up in a 256-row table holding the value(s) of every byte, so a
4-bit byte becomes its two values in one gather.
"""

from __future__ import annotations

import functools

import torch

from .elements import ElementType

__all__ = ["code_values", "decode", "encode", "pack_nibbles", "per_byte", "unpack_nibbles"]


def per_byte(element: ElementType) -> int:
    """Codes per byte: 2 for 4-bit elements, else 1 (6-bit codes take a whole byte)."""
    return 2 if element.bits == 4 else 1


def encode(q: torch.Tensor, x: torch.Tensor, element: ElementType) -> torch.Tensor:
    """uint8 codes ``(rows, ceil(cols / per_byte))`` of the rounded grid values ``q``
    (work dtype, any signs, clobbered; columns beyond ``x``'s are dropped) with the signs
    of ``x`` (``(rows, cols)``)."""
    mag = element.magnitude_codes(q.abs_())[:, : x.shape[1]]
    codes = mag.to(torch.uint8)
    codes.bitwise_or_(torch.signbit(x).to(torch.uint8).bitwise_left_shift_(element.bits - 1))
    return pack_nibbles(codes) if per_byte(element) == 2 else codes


def decode(
    codes: torch.Tensor, element: ElementType, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The values of the uint8 ``codes`` ``(rows, n)`` as ``(rows, n * per_byte)`` in
    ``dtype`` (a packed row's padding nibble comes back as a trailing 0), into the
    contiguous ``out`` when given."""
    table = _byte_table(element, dtype, codes.device)
    index = codes.reshape(-1).int()
    if out is None:
        return table.index_select(0, index).view(codes.shape[0], -1)
    torch.index_select(table, 0, index, out=out.view(-1, table.shape[1]))
    return out


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim: ``(rows, n)`` -> ``(rows, ceil(n/2))``."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 1].bitwise_left_shift(4).bitwise_or_(pairs[..., 0])


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`pack_nibbles` reversed: the first ``n`` codes of each row."""
    pairs = torch.stack([packed.bitwise_and(0xF), packed.bitwise_right_shift(4)], dim=-1)
    return pairs.view(*packed.shape[:-1], -1)[..., :n]


def code_values(element: ElementType, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value of each code ``0 .. 2**bits - 1`` (negative half: ``-0`` first)."""
    mags = torch.tensor(element.magnitude_values(), dtype=dtype)
    return torch.cat([mags, -mags])


@functools.cache
def _byte_table(element: ElementType, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``(256, per_byte)``: the value(s) each byte holds (NaN for bytes never written)."""
    values = torch.full((256,), float("nan"), dtype=dtype)
    values[: 2**element.bits] = code_values(element, dtype)
    byte = torch.arange(256)
    if per_byte(element) == 2:
        return torch.stack([values[byte & 0xF], values[byte >> 4]], dim=1).to(device)
    return values.view(256, 1).to(device)
