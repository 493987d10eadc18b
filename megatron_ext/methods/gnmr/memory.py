"""The peak-memory bound of the paper's App. D: what promoting at most maxO units can cost.

Promoting a unit widens the activations its GEMMs keep for the backward pass. App. D counts,
per eligible operator ``b``, the elements ``A_b`` it saves for backward, and bounds the extra
bytes at step ``t`` over the all-low baseline, with ``S_t`` the promoted set (``|S_t| ≤ maxO``)::

    ΔM_t = Σ_{b∈S_t} A_b · (p_high - p_low)/8                                       (61)
         ≤ Σ_{b ∈ TopK(B, maxO; A_b)} A_b · (p_high - p_low)/8  ≤  maxO · A_max · (p_high - p_low)/8   (62)

Here the bits may differ per site (a base plan mixes formats), so the ranked quantity is a
unit's extra bytes ``E_u = Σ_{site∈u} A_site · (p_high,site - p_low,site) / 8``.

**What a site saves.** Its input ``x`` — wgrad (``dw = dy.T @ x``) needs it; ``dy`` is made
and used inside the backward, and the weight is not an activation. With ``T = s·b`` tokens
per micro-batch, ``K`` the site's input width (``ModelShape.site_nk``) and TP size ``t``,
one GPU saves::

    qkv, fc1 (column-parallel: input replicated)     A = T · K       (T/t · K with --sequence-parallel:
                                                                     megatron saves the local
                                                                     sequence shard, gathers again)
    proj, fc2 (row-parallel: input split along K)    A = T · K/t

``p`` is the *effective* bits per element of the format wgrad reads ``x`` in (element bits
plus the block scale's share, ``Format.effective_bits``: FP4 with 1x128 tiles is 4.25), the
run's own dtype for passthrough. Real low-precision kernels keep the quantized ``x``;
this project's emulated GEMMs (:mod:`megatron_ext.precision.gemm`) keep ``x`` in the compute
dtype whatever the format, so under emulation the measured extra memory is 0 and the bound
describes the hardware path.

**At a pipeline layout.** A GPU of stage ``k`` holds its own units only, and holds the
activations of ``m_k`` micro-batches at its peak (1F1B: ``min(p - k, m)``;
``megatron_ext.training.dry_run.estimates.in_flight``). The promoted set is fixed for the
whole step, so every in-flight micro-batch of a promoted unit is wide, and::

    ΔM_k ≤ m_k · Σ_{u ∈ TopK(units of stage k, maxO; E_u)} E_u ≤ m_k · min(maxO, U_k) · max_u E_u

(the budget counts units over all stages, so in the worst case all maxO sit on one stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from megatron_ext.formats import get_format
from megatron_ext.methods.gnmr.promote import promoted_formats
from megatron_ext.methods.gnmr.units import unit_sites
from megatron_ext.precision.cost import ModelShape
from megatron_ext.precision.site_formats import PASSTHROUGH, SiteFormats
from megatron_ext.sites import COLUMN_SITES, parse_site_id


@dataclass(frozen=True)
class ActivationLayout:
    """The step shape and parallel layout the saved-activation count needs."""

    tokens: int
    """Tokens per micro-batch ``T = s·b`` (sequence length x micro-batch size)."""
    tp: int
    """Tensor-parallel size ``t``."""
    sequence_parallel: bool
    """``--sequence-parallel``: column-parallel sites save a ``1/t`` sequence shard."""


@dataclass(frozen=True)
class MemoryBound:
    """Eq. 62 for one GPU of a pipeline stage, in bytes."""

    topk: float
    """``m_k`` times the sum of the ``min(maxO, U_k)`` largest unit extras (the tight form)."""
    loose: float
    """``m_k · min(maxO, U_k) · max_u E_u`` (the right-hand form)."""


def saved_elements(shape: ModelShape, site: str, layout: ActivationLayout) -> float:
    """``A``: elements of ``x`` one GPU saves for one micro-batch of a ``site``."""
    _, k = shape.site_nk(site)
    if site in COLUMN_SITES:
        rows = layout.tokens / layout.tp if layout.sequence_parallel else layout.tokens
        return rows * k
    return layout.tokens * k / layout.tp


def stored_bits(formats: SiteFormats, native_bits: int) -> float:
    """Effective bits per element of the ``x`` wgrad reads (``native_bits`` = the run's dtype,
    for passthrough)."""
    name = formats.operand("wgrad", "x")
    return float(native_bits) if name == PASSTHROUGH else get_format(name).effective_bits


def site_bits(base: SiteFormats, high: str, native_bits: int = 16) -> tuple[float, float]:
    """``(p_low, p_high)`` of a site: its saved ``x`` before and after promotion."""
    return stored_bits(base, native_bits), stored_bits(promoted_formats(base, high), native_bits)


def unit_extra_bytes(shape: ModelShape, layout: ActivationLayout, unit: str,
                     bits: Mapping[str, tuple[float, float]]) -> float:
    """``E_u``: extra bytes per micro-batch when ``unit`` runs high; ``bits`` maps its site
    ids to ``(p_low, p_high)`` (:func:`site_bits`; a site not in it is not low precision)."""
    total = 0.0
    for sid in unit_sites(unit):
        low, high = bits.get(sid, (0.0, 0.0))
        total += saved_elements(shape, parse_site_id(sid)[1], layout) * max(high - low, 0.0) / 8
    return total


def peak_extra_bytes(unit_extras: Sequence[float], budget: int, in_flight: int) -> MemoryBound:
    """Eq. 62 for a GPU holding units with extras ``unit_extras`` (:func:`unit_extra_bytes`)
    and ``in_flight`` micro-batches at its peak, at most ``budget`` (maxO) units promoted."""
    k = min(budget, len(unit_extras))
    top = sorted(unit_extras, reverse=True)[:k]
    largest = top[0] if top else 0.0
    return MemoryBound(in_flight * sum(top), in_flight * k * largest)
