"""Real quantized tensors: ``quantize`` to packed codes and scales, ``dequantize`` back.

``fake_quant(x, fmt)`` computes ``q * dequant`` and throws ``q`` away; ``quantize(x, fmt)``
keeps it: the same passes (:func:`.pipeline.rounded_chunks`: amax, factors, ``x * quant``,
rounding, the same random draws) hand over the rounded grid values ``q`` and each block's
scale, and those are stored in the format's own bits::

    codes   uint8, the element code of each q with the sign of x (:mod:`.codes`):
            4-bit elements two per byte, 6- and 8-bit one per byte
    scales  one per block, in its real type: float32 d (tensor/row/tile/block),
            an E8M0 byte (mx), an E4M3 byte (nv) plus one float32 tensor scale

``dequantize`` looks the codes up, multiplies by the scales' dequantization factor with
the same rule (:meth:`.Scaling.dequant`) and rounds to the input dtype, so
``dequantize(quantize(x, fmt)) == fake_quant(x, fmt)`` bit for bit, signed zeros included
(``(±|q|) * d`` is ``copysign(|q| * d, x)``: rounding is symmetric). NaN and ±inf have no
code: their flat positions and exact values are kept aside (usually none).

Plain casts (``bf16``, ``fp16``, ``fp32``) store the cast tensor itself. float64 inputs
keep float64 amax / tensor scales (their work dtype), so they round-trip exactly too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .codes import decode, encode, per_byte
from .elements import CastElement
from .pipeline import FLOAT_DTYPES, blocking, check_dtype, from_2d, rounded_chunks, to_2d
from .registry import Format, get_format
from .rounding import work_dtype
from .scaling import ColScaling, Scaling

__all__ = ["QuantizedTensor", "dequantize", "quantize"]


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A tensor stored in a low-precision format: packed codes plus per-block scales.

    The data is laid out as ``fake_quant`` sees it: ``axis`` moved innermost and the other
    dimensions flattened into ``rows``, so ``codes`` and ``scales`` are 2-D (a 0-d tensor
    is 1x1). All fields are plain tensors or plain values (see :meth:`to_dict`).
    """

    codes: torch.Tensor
    """Element codes ``(rows, ceil(cols / per_byte))`` uint8, ``per_byte`` 2 for 4-bit
    elements (low nibble = even column) and 1 otherwise; for plain casts the cast tensor
    ``(rows, cols)`` in the cast dtype."""
    scales: torch.Tensor
    """Block scales ``(row_blocks, col_blocks)``: float32 ``d`` (float64 for float64
    inputs) for amax scaling, uint8 E8M0 bytes for mx, uint8 E4M3 bytes for nv; empty
    ``(0,)`` for unscaled formats and casts."""
    fmt: Format
    """The format (a name is accepted and looked up)."""
    shape: tuple[int, ...]
    """Shape of the original tensor."""
    dtype: torch.dtype
    """Dtype of the original tensor (and of :meth:`dequantize`'s result)."""
    axis: int
    """The blocked dimension of the original tensor (non-negative)."""
    tensor_scale: torch.Tensor | None = None
    """NVFP4's float32 tensor scale (0-d; float64 for float64 inputs); ``None`` otherwise."""
    nonfinite_index: torch.Tensor | None = None
    """Flat ``rows x cols`` positions (int64) of NaN / ±inf inputs (empty when none)."""
    nonfinite_value: torch.Tensor | None = None
    """The values at ``nonfinite_index``, exactly as given (``dtype``)."""

    def __post_init__(self):
        def set_(name, value):
            object.__setattr__(self, name, value)

        set_("fmt", get_format(self.fmt))
        set_("shape", tuple(int(n) for n in self.shape))
        set_("axis", range(max(len(self.shape), 1))[self.axis])
        if self.nonfinite_index is None:
            set_("nonfinite_index", torch.empty(0, dtype=torch.int64, device=self.codes.device))
            set_("nonfinite_value", torch.empty(0, dtype=self.dtype, device=self.codes.device))
        _check(self)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales, the tensor scale and any NaN / inf kept aside."""
        parts = (self.codes, self.scales, self.tensor_scale)
        parts += (self.nonfinite_index, self.nonfinite_value)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @property
    def device(self) -> torch.device:
        """Where the codes live."""
        return self.codes.device

    def dequantize(self) -> torch.Tensor:
        """The values back, in ``shape`` and ``dtype`` (see :func:`dequantize`)."""
        return dequantize(self)

    def to_dict(self) -> dict:
        """Plain tensors and values (for ``torch.save`` or a ``state_dict``)."""
        out = {
            "format": self.fmt.canonical,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "axis": self.axis,
            "codes": self.codes,
            "scales": self.scales,
            "nonfinite_index": self.nonfinite_index,
            "nonfinite_value": self.nonfinite_value,
        }
        if self.tensor_scale is not None:
            out["tensor_scale"] = self.tensor_scale
        return out

    @classmethod
    def from_dict(cls, d: dict) -> QuantizedTensor:
        """:meth:`to_dict` reversed (``ValueError`` on a missing key or a bad dtype)."""
        dtype = getattr(torch, str(d.get("dtype")), None)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"QuantizedTensor: bad dtype {d.get('dtype')!r}")
        try:
            fields = {k: d[k] for k in ("shape", "axis", "codes", "scales")}
            fields |= {k: d[k] for k in ("nonfinite_index", "nonfinite_value")}
            return cls(fmt=d["format"], dtype=dtype, tensor_scale=d.get("tensor_scale"), **fields)
        except KeyError as err:
            raise ValueError(f"QuantizedTensor: missing key {err}") from None


@torch.no_grad()
def quantize(
    x: torch.Tensor,
    fmt: str | Format,
    axis: int = -1,
    generator: torch.Generator | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt``, keeping the codes and scales (arguments as ``fake_quant``;
    the same ``generator`` state gives the same stochastic rounding)."""
    fmt = get_format(fmt)
    check_dtype(x, "quantize")
    if isinstance(fmt.scaling, ColScaling):
        raise ValueError(f"{fmt.name}: per-column scales have no packed storage (fake_quant "
                         "only)")
    x2, axis = to_2d(x, axis)
    fields = _quantize_2d(x2, fmt, generator)
    return QuantizedTensor(fmt=fmt, shape=tuple(x.shape), dtype=x.dtype, axis=axis, **fields)


@torch.no_grad()
def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """The tensor ``qt`` stands for: ``fake_quant`` of the original, bit for bit."""
    if isinstance(qt.fmt.element, CastElement):
        y2 = qt.codes.to(qt.dtype)
        y2 = y2.clone() if y2 is qt.codes else y2
    else:
        y2 = _dequantize_2d(qt)
    if qt.nonfinite_index.numel():
        y2.view(-1)[qt.nonfinite_index] = qt.nonfinite_value
    return from_2d(y2, qt.shape, qt.axis)


def scale_grid(scaling: Scaling, rows: int, cols: int) -> tuple[int, int]:
    """``(row_blocks, col_blocks)`` of a ``rows x cols`` tensor."""
    row_blocks = -(-rows // scaling.rows) if scaling.rows else 1
    col_blocks = -(-cols // scaling.cols) if scaling.cols else 1
    return row_blocks, col_blocks


def _quantize_2d(x2: torch.Tensor, fmt: Format, generator) -> dict:
    """codes, scales, tensor_scale and the non-finite entries of the contiguous 2-D ``x2``."""
    element, scaling = fmt.element, fmt.scaling
    no_scales = torch.empty(0, dtype=work_dtype(x2.dtype), device=x2.device)
    if isinstance(element, CastElement):
        codes = x2.to(element.dtype)
        return {"codes": codes.clone() if codes is x2 else codes, "scales": no_scales}
    rows, cols = x2.shape
    codes = torch.empty((rows, -(-cols // per_byte(element))), dtype=torch.uint8, device=x2.device)
    if x2.numel() == 0:
        return {"codes": codes, **_empty_scales(x2, fmt, no_scales)}
    out = {"codes": codes, "scales": no_scales}
    bad = []
    for chunk in rounded_chunks(x2, fmt, generator):
        xc = x2[chunk.rows]
        if chunk.nonfinite:
            finite = torch.isfinite(xc)
            chunk.w[:, :cols].masked_fill_(~finite, 0)
            bad.append(chunk.start * cols + (~finite).view(-1).nonzero()[:, 0])
        codes[chunk.rows] = encode(chunk.w, xc, element)
        if chunk.factors is not None:
            _store_scales(out, chunk, scaling, rows, cols)
    if bad:
        index = torch.cat(bad)
        out |= {"nonfinite_index": index, "nonfinite_value": x2.view(-1)[index]}
    return out


def _store_scales(out: dict, chunk, scaling: Scaling, rows: int, cols: int) -> None:
    """Write the chunk's block scales, in their storage type, into ``out["scales"]``."""
    grid = scale_grid(scaling, rows, cols)
    block = scaling.encode_scales(chunk.factors.block_scale).reshape(-1, grid[1])
    if out["scales"].shape != grid:
        out["scales"] = torch.empty(grid, dtype=block.dtype, device=block.device)
    b0 = chunk.start // scaling.rows if scaling.rows else 0
    out["scales"][b0 : b0 + block.shape[0]] = block
    out["tensor_scale"] = chunk.factors.tensor_scale


def _empty_scales(x2: torch.Tensor, fmt: Format, no_scales: torch.Tensor) -> dict:
    """The scales of an empty tensor: those of all-zero blocks."""
    work = no_scales.dtype
    amax = torch.zeros(scale_grid(fmt.scaling, *x2.shape), dtype=work, device=x2.device)
    factors = fmt.scaling.factors(amax, fmt.element, amax.new_zeros(()))
    if factors is None:
        return {"scales": no_scales}
    scales = fmt.scaling.encode_scales(factors.block_scale)
    return {"scales": scales, "tensor_scale": factors.tensor_scale}


def _dequantize_2d(qt: QuantizedTensor) -> torch.Tensor:
    """The ``(rows, cols)`` values of a non-cast ``qt``, chunk by chunk as ``fake_quant``."""
    element, scaling = qt.fmt.element, qt.fmt.scaling
    rows, cols = _rows_cols(qt)
    work = work_dtype(qt.dtype)
    y = torch.empty((rows, cols), dtype=qt.dtype, device=qt.device)
    if y.numel() == 0:
        return y
    dequant = None
    if scaling.scale_bits:
        tensor_scale = qt.tensor_scale.to(work) if qt.tensor_scale is not None else None
        dequant = scaling.dequant(scaling.decode_scales(qt.scales, work), tensor_scale)
    plan = blocking(y, scaling)
    width = qt.codes.shape[1] * per_byte(element)  # decoded row: cols, or cols + 1 nibble
    direct = width == plan.padded == cols and qt.dtype == work  # no padding, no cast
    for r0, r1 in plan.chunks(rows):
        q = decode(qt.codes[r0:r1], element, work, out=y[r0:r1] if direct else None)
        if width != plan.padded:  # ragged row: widen to whole blocks
            q = torch.nn.functional.pad(q[:, :cols], (0, plan.padded - cols))
        if dequant is not None:
            shape4 = plan.shape4(r1 - r0)
            b0 = r0 // scaling.rows if scaling.rows else 0
            d = dequant[b0 : b0 + shape4[0]]
            q.view(shape4).mul_(d.view(d.shape[0], 1, d.shape[1], 1))
        if not direct:
            y[r0:r1] = q[:, :cols]
    return y


def _rows_cols(qt: QuantizedTensor) -> tuple[int, int]:
    """Rows and columns of the 2-D layout (``axis`` innermost)."""
    if not qt.shape:
        return 1, 1
    rest = qt.shape[: qt.axis] + qt.shape[qt.axis + 1 :]
    return math.prod(rest), qt.shape[qt.axis]


def _check(qt: QuantizedTensor) -> None:
    """``ValueError`` unless the fields fit together (e.g. after ``from_dict``)."""
    element, scaling = qt.fmt.element, qt.fmt.scaling
    if qt.dtype not in FLOAT_DTYPES:
        raise ValueError(f"QuantizedTensor: dtype {qt.dtype} is not a float dtype")
    rows, cols = _rows_cols(qt)
    if isinstance(element, CastElement):
        want_codes, codes_dtype = (rows, cols), element.dtype
    else:
        want_codes, codes_dtype = (rows, -(-cols // per_byte(element))), torch.uint8
    want_scales = scale_grid(scaling, rows, cols) if scaling.scale_bits else (0,)
    scales_dtype = scaling.scale_dtype or work_dtype(qt.dtype)
    got = (tuple(qt.codes.shape), qt.codes.dtype, tuple(qt.scales.shape))
    needs_tensor_scale = bool(scaling.scale_bits and scaling.needs_tensor_amax)
    if (
        got != (want_codes, codes_dtype, want_scales)
        or (scaling.scale_bits and qt.scales.dtype != scales_dtype)
        or needs_tensor_scale != (qt.tensor_scale is not None)
    ):
        raise ValueError(
            f"QuantizedTensor: codes {got[0]} {got[1]} and scales {got[2]} "
            f"{qt.scales.dtype} do not fit "
            f"{qt.fmt.name} of shape {qt.shape} along axis {qt.axis} (want codes "
            f"{want_codes} {codes_dtype}, scales {want_scales} {scales_dtype}"
            f"{', and a tensor scale' if needs_tensor_scale else ''})"
        )
