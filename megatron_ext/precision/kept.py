"""What a quantized GEMM keeps for its backward beyond what megatron's linear keeps, in bytes.

megatron's linear keeps its input ``x`` (under sequence parallelism this rank's rows of it)
and its weight, the parameter; the dry run counts the first in the activations (Korthikanti's
formula) and the second in the model state. The quantized GEMM (:mod:`.gemm`) keeps:

* **fprop's quantized weight** ``q(w)``, where dgrad reuses it (weight formats that are
  :func:`~.site_formats.same_either_way`: one scale per tensor, 128x128 blocks) and fprop is
  emulated: a weight-sized copy in the parameters' dtype. With the weight cache (several
  micro-batches a step, :mod:`.weight_cache`) the step's micro-batches share one copy; without
  it every micro-batch in flight holds its own. On the TinyLlama-1.1B shape this is the
  1.8 GiB by which ``uniform:fp8`` emulated peaked above BF16 on the H100 (28.4 vs 26.6 GiB).
* **the FP8 weights** of a real FP8 fprop, with the weight cache: one byte a weight for
  fprop's ``q(w)`` while a step of several micro-batches runs its forwards, and one byte a
  weight for dgrad's ``q(w)`` along N (fprop's transposed, per tensor) from the step's first
  forward to its last backward, where dgrad runs real.
* **q(x) in FP8** for a real FP8 wgrad whose ``x`` format is axis-free, instead of ``x``: one
  byte a value instead of two (BF16), a saving, except where ``x``'s producer keeps ``x``
  anyway (fused attention's output entering ``proj``), where the FP8 copy comes on top.

An emulated ``q(x)`` kept in ``x``'s place has ``x``'s size: nothing changes. Not counted:
what lives only while one GEMM runs (a quantized operand, the gathered ``x`` under sequence
parallelism), the scales (at most 4 bytes per 128 values for 1x128 tiles, one per row or
tensor otherwise), sites Transformer Engine runs, and a method's recomputed weight (GaussWS's
ŵ keeps no ``q(ŵ)``: there the weight copy is an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.precision.cost import ModelShape
from megatron_ext.precision.gemm import changes
from megatron_ext.precision.real_gemm import fits_real, fp8_x_serves_wgrad
from megatron_ext.precision.site_formats import GemmOperands
from megatron_ext.sites import COLUMN_SITES


@dataclass(frozen=True)
class SiteGeometry:
    """One site's GEMMs on one GPU for one micro-batch."""

    tokens: int
    """Rows ``T`` of the ``x`` the GEMM reads (``s·b``; gathered under sequence parallelism)."""
    n: int
    """Output features of this GPU's weight shard."""
    k: int
    """Input features of this GPU's weight shard."""
    kept_rows: int
    """Rows of ``x`` the GEMM keeps for wgrad (``T/t`` for a column layer under SP)."""
    producer_keeps_x: bool
    """Whether ``x``'s producer keeps it for its own backward (fused attention -> ``proj``)."""


def site_geometry(shape: ModelShape, site: str, tokens: int, tp: int, sequence_parallel: bool,
                  fused_attention: bool) -> SiteGeometry:
    """``site``'s geometry on one GPU of a ``tp``-way tensor-parallel layout for ``tokens``
    tokens: a column layer (:data:`~megatron_ext.sites.COLUMN_SITES`) holds ``N/t`` output
    rows and, under SP, keeps ``T/t`` rows of ``x``; a row layer holds ``K/t`` input columns;
    ``fused_attention``: the core attention keeps its output (``proj``'s input)."""
    n, k = shape.site_nk(site)
    if site in COLUMN_SITES:
        return SiteGeometry(tokens, n // tp, k, tokens // tp if sequence_parallel else tokens,
                            False)
    return SiteGeometry(tokens, n, k // tp, tokens, site == "proj" and fused_attention)


@dataclass(frozen=True)
class KeptBytes:
    """Bytes one site keeps beyond megatron's linear (module docstring)."""

    per_step: float = 0.0
    """Held once while a step runs (the weight cache's entry)."""
    per_micro_batch: float = 0.0
    """Held by each micro-batch in flight; negative where the GEMM keeps less."""


def kept_bytes(ops: GemmOperands, geometry: SiteGeometry, dtype: torch.dtype, real: bool,
               cached: bool, micro_batches: int) -> KeptBytes:
    """What a site with operand formats ``ops`` keeps beyond megatron's linear in a run of
    parameters and activations in ``dtype``; ``real``: FP8 GEMMs run for real where their
    formats and shapes allow (:func:`~.real_gemm.fits_real`); ``cached``: the weight cache
    is on, for steps of ``micro_batches``."""
    g, size = geometry, dtype.itemsize
    weights = g.n * g.k
    if real and fits_real(ops.fprop_x, ops.fprop_w, g.tokens, g.k, g.n):
        wgrad_real = fits_real(ops.wgrad_dy, ops.wgrad_x, g.n, g.tokens, g.k)
        micro = 0.0
        if wgrad_real and fp8_x_serves_wgrad(ops):
            x_values = g.kept_rows * g.k
            micro = x_values * (1 if g.producer_keeps_x else 1 - size)
        dgrad_real = fits_real(ops.dgrad_dy, ops.dgrad_w, g.tokens, g.n, g.k)
        copies = (micro_batches > 1) + dgrad_real if cached else 0
        return KeptBytes(float(weights * copies), micro)
    if ops.dgrad_reuses_fprop_w and changes(ops.fprop_w, dtype):
        copy = float(weights * size)
        return KeptBytes(copy, 0.0) if cached and micro_batches > 1 else KeptBytes(0.0, copy)
    return KeptBytes()
