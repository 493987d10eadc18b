"""The cost model: linear-layer FLOPs by the precision they run at, overall and per stage.

Each GEMM of a site with ``T`` tokens, ``N`` output and ``K`` input features costs
``2·T·N·K`` FLOPs — fprop (T x K times K x N), dgrad (T x N times N x K) and wgrad (N x T
times T x K) alike, so a site costs ``3 · 2·T·N·K`` per step. A GEMM runs at the rate of its
**wider** operand (a mixed-input tensor-core MMA runs at the slower format's rate), so its
class is that of the wider operand, by element bits:

* ``fp4``: at most 4 bits (E2M1, INT4, MXFP4, NVFP4);
* ``fp8``: 5 to 8 bits (E4M3, E5M2, the FP6 formats, INT8 — Blackwell runs FP6 at FP8 rate);
* ``bf16``: everything wider, and passthrough (the run's own BF16/FP32).

FP4 is 2x FP8 and FP8 2x BF16 throughput, so the GEMM time relative to all-BF16 is
``bf16 + fp8/2 + fp4/4`` (fractions of FLOPs). SNIP's efficiency metric is the ``fp4``
fraction. Shapes are the global (unsharded) ones from the model flags; TP does not change the
fractions and PP only groups layers into stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.formats import get_format
from megatron_ext.sites import GEMM_ROLES, SITES, site_id
from megatron_ext.precision.sites import PASSTHROUGH, SiteFormats

CLASSES = ("fp4", "fp8", "bf16")
"""Precision classes of a GEMM, fastest first."""

SPEED = {"fp4": 4.0, "fp8": 2.0, "bf16": 1.0}
"""Throughput of each class relative to BF16."""


def operand_class(name: str) -> str:
    """Precision class of one operand format name."""
    if name == PASSTHROUGH:
        return "bf16"
    bits = get_format(name).bits
    return "fp4" if bits <= 4 else "fp8" if bits <= 8 else "bf16"


def gemm_class(a: str, b: str) -> str:
    """Class of a GEMM reading operand formats ``a`` and ``b``: the wider one's."""
    return max(operand_class(a), operand_class(b), key=CLASSES.index)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs to know about the model and the step."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """MLP inner width (of each of gate and up for SwiGLU)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads."""
    swiglu: bool
    """Gated MLP: fc1 computes gate and up (twice the outputs)."""
    tokens: int
    """Tokens per step: global batch size x sequence length."""
    pipeline_stages: int = 1
    """PP size."""
    layers_per_virtual_stage: int | None = None
    """Layers per virtual-pipeline chunk (interleaved schedule), or None."""

    @classmethod
    def from_args(cls, args) -> "ModelShape":
        return cls(args.num_layers, args.hidden_size, args.ffn_hidden_size,
                   args.num_attention_heads, args.num_query_groups, bool(args.swiglu),
                   args.global_batch_size * args.seq_length, args.pipeline_model_parallel_size,
                   args.num_layers_per_virtual_pipeline_stage)

    def site_nk(self, site: str) -> tuple[int, int]:
        """(N, K) of a site's weight, unsharded."""
        head_dim = self.hidden_size // self.num_attention_heads
        q_width = self.num_attention_heads * head_dim
        return {
            "qkv": (q_width + 2 * self.num_query_groups * head_dim, self.hidden_size),
            "proj": (self.hidden_size, q_width),
            "fc1": (self.ffn_hidden_size * (2 if self.swiglu else 1), self.hidden_size),
            "fc2": (self.hidden_size, self.ffn_hidden_size),
        }[site]

    def stage_of(self, layer: int) -> int:
        """Pipeline stage holding global ``layer`` (megatron's even split; with virtual
        stages, chunk ``c`` of ``layers_per_virtual_stage`` layers sits on stage ``c % PP``)."""
        per_chunk = self.layers_per_virtual_stage or self.num_layers // self.pipeline_stages
        return (layer // per_chunk) % self.pipeline_stages


@dataclass(frozen=True)
class FlopReport:
    """Linear-layer FLOPs per step, split by precision class."""

    total: float
    """All linear-site GEMM FLOPs of a step (output layer and attention excluded)."""
    fractions: dict[str, float]
    """Class -> fraction of ``total``."""
    stage_fractions: list[dict[str, float]]
    """Per pipeline stage: class -> fraction of that stage's FLOPs."""

    @property
    def time_vs_bf16(self) -> float:
        """Estimated GEMM time relative to running every GEMM in BF16."""
        return sum(self.fractions[c] / SPEED[c] for c in CLASSES)

    def metrics(self) -> dict[str, float]:
        """Flat ``{"fp4_flop_frac": .., "fp4_flop_frac_stage0": .., ...}`` for logging."""
        out = {f"{c}_flop_frac": self.fractions[c] for c in CLASSES}
        if len(self.stage_fractions) > 1:
            for stage, fractions in enumerate(self.stage_fractions):
                out.update({f"{c}_flop_frac_stage{stage}": fractions[c] for c in CLASSES})
        out["gemm_time_vs_bf16"] = self.time_vs_bf16
        return out


def flop_report(formats_of, shape: ModelShape) -> FlopReport:
    """Account every GEMM of every site; ``formats_of(site_id) -> SiteFormats``."""
    stages = [dict.fromkeys(CLASSES, 0.0) for _ in range(shape.pipeline_stages)]
    for layer in range(shape.num_layers):
        for site in SITES:
            n, k = shape.site_nk(site)
            formats: SiteFormats = formats_of(site_id(layer, site))
            for gemm, (a, b) in GEMM_ROLES.items():
                cls = gemm_class(formats.operand(gemm, a), formats.operand(gemm, b))
                stages[shape.stage_of(layer)][cls] += 2.0 * shape.tokens * n * k
    total = sum(sum(s.values()) for s in stages)
    fractions = {c: sum(s[c] for s in stages) / total for c in CLASSES}
    per_stage = [{c: s[c] / sum(s.values()) for c in CLASSES} for s in stages]
    return FlopReport(total, fractions, per_stage)
