"""Storage of unsigned integer codes at 4, 8 or 16 bits: two 4-bit codes per byte.

A code ``u`` of a ``b``-bit quantizer is an integer in ``[0, 2**b)``. It is stored as

* ``b = 4``: ``uint8``, two codes per byte — element ``2i`` in the low nibble, ``2i + 1`` in
  the high nibble (the order torchao and the OCP MX spec use for FP4);
* ``b = 8``: ``uint8``, one code per byte;
* ``b = 16``: ``int16`` holding ``u - 2**15`` (torch has no general ``uint16`` arithmetic).

So ``n`` codes take exactly ``n * b / 8`` bytes (``n`` even at 4 bits).
"""

from __future__ import annotations

import torch

STORED_BITS = (4, 8, 16)
"""Widths that are stored as codes (32 bits is the float32 value itself)."""


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes in ``[0, 2**bits)`` (any integer dtype, 1-D) -> their storage tensor."""
    if bits == 4:
        if codes.numel() % 2:
            raise ValueError(f"4-bit packing needs an even number of codes, got {codes.numel()}")
        pairs = codes.to(torch.uint8).view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 16:
        return (codes.to(torch.int32) - 32768).to(torch.int16)
    raise ValueError(f"codes are stored at {STORED_BITS} bits, not {bits}")


def unpack(stored: torch.Tensor, bits: int) -> torch.Tensor:
    """The storage tensor -> the codes as ``int32`` (inverse of :func:`pack`)."""
    if bits == 4:
        low = (stored & 0x0F).to(torch.int32)
        high = (stored >> 4).to(torch.int32)
        return torch.stack([low, high], dim=1).view(-1)
    if bits == 8:
        return stored.to(torch.int32)
    if bits == 16:
        return stored.to(torch.int32) + 32768
    raise ValueError(f"codes are stored at {STORED_BITS} bits, not {bits}")
