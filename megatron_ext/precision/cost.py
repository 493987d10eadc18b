"""The one cost model: FLOPs and times of the linear GEMMs by precision, and a stage's fixed time.

**FLOPs.** Each GEMM of a site with ``T`` tokens, ``N`` output and ``K`` input features costs
``2·T·N·K`` FLOPs — fprop (T x K times K x N), dgrad (T x N times N x K) and wgrad (N x T
times T x K) alike, so a site costs ``3 · 2·T·N·K`` per pass over ``T`` tokens. A GEMM runs
at the rate of its **wider** operand (a mixed-input tensor-core MMA runs at the slower
format's rate), so its class is that of the wider operand, by element bits:

* ``fp4``: at most 4 bits (E2M1, INT4, MXFP4, NVFP4);
* ``fp8``: 5 to 8 bits (E4M3, E5M2, the FP6 formats, INT8 — Blackwell runs FP6 at FP8 rate);
* ``bf16``: everything wider, and passthrough (the run's own BF16/FP32).

**Times** come from a :class:`~megatron_ext.precision.device_profile.DeviceProfile`: a GEMM
whose two operands are native on the device runs at the slower one's rate plus the
quantization of its operands; any other quantized GEMM is emulated, its operands quantized and
dequantized, then a BF16 GEMM (never faster than BF16; docs/cost_model.md). The default
profile, ``nominal``, is the SNIP paper's model: FP4 2x FP8 and FP8 2x BF16 throughput, free
quantization, so at a BF16 rate ``R`` a GEMM of class ``c`` takes ``2·T·N·K / (R · speed(c))``
seconds and the GEMM time relative to all-BF16 is ``bf16 + fp8/2 + fp4/4`` (fractions of
FLOPs). FLOP fractions (SNIP's efficiency metric) never depend on the profile. What no plan
changes is a stage's **fixed time**, in BF16: the attention core of each of its layers, ``6·T·s·h`` (QKᵀ and PV, ``2·T·s·h``
each forward, the causal half of that, forward + backward = 3 x forward; ``s`` the sequence
length, ``h`` the width), plus on the last stage the output layer, ``6·T·v·h`` (``v`` the
padded vocabulary), plus the profile's measured non-GEMM time per token and layer (0 unless
measured, :func:`calibrate`). SNIP's efficiency metric is the ``fp4`` fraction; its ILP weighs option
times against the fixed times; the dry run adds them up per stage.

**Roofline.** Lower precision only speeds up a GEMM whose time is set by its arithmetic, not by
moving its operands: a GEMM ``(m x k) @ (k x n)`` does ``2·m·n·k`` FLOPs and moves at least
``bytes · (m·k + k·n + m·n)`` (both operands read once, the output written once; BF16, 2 bytes),
so its **arithmetic intensity** is ``2·m·n·k / (bytes · (m·k + k·n + m·n))`` FLOP/byte. A
device's **ridge point** is its peak BF16 rate over its memory bandwidth; a GEMM above the
ridge is compute-bound (the roofline model, Williams et al. 2009). A linear site's three GEMMs
read the same three matrices (``T x K``, ``N x K``, ``T x N``), so they share one intensity.
:data:`DEVICES` holds the datasheet peaks (dense, no sparsity) PGQ's roofline filter uses.

Shapes are the global (unsharded) ones from the model flags; TP divides a stage's time but
not the fractions, and PP only groups layers into stages. ``T`` is whatever the caller
counts: a step's tokens (global batch x sequence: FLOP fractions, SNIP's problem) or a
micro-batch's (the dry run's per-micro-batch times).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ext.formats import get_format
from megatron_ext.precision.device_profile import PROFILES, DeviceProfile, quantized
from megatron_ext.sites import GEMM_ROLES, SITES, site_id
from megatron_ext.precision.site_formats import PASSTHROUGH, SiteFormats

CLASSES = ("fp4", "fp8", "bf16")
"""Precision classes of a GEMM, fastest first."""

SPEED = {"fp4": 4.0, "fp8": 2.0, "bf16": 1.0}
"""Throughput of each class relative to BF16 in the ``nominal`` profile (the paper's)."""

BF16_FLOPS_PER_S = 989e12
"""Default BF16 rate ``R``: the dense BF16 tensor-core peak of an H100 SXM."""


@dataclass(frozen=True)
class Device:
    """An accelerator's roofline: peak dense BF16 rate and memory bandwidth (datasheet)."""

    name: str
    """What it is, for reports."""
    bf16_flops_per_s: float
    """Dense BF16 tensor-core peak, FLOP/s."""
    bytes_per_s: float
    """Memory (HBM / DRAM) bandwidth, bytes/s."""

    @property
    def ridge(self) -> float:
        """FLOP/byte above which a GEMM is compute-bound."""
        return self.bf16_flops_per_s / self.bytes_per_s


DEVICES = {
    "h100": Device("H100 SXM (989 TFLOP/s BF16, 3.35 TB/s HBM3)", 989e12, 3.35e12),
    "h200": Device("H200 SXM (989 TFLOP/s BF16, 4.8 TB/s HBM3e)", 989e12, 4.8e12),
    "b200": Device("B200 HGX 1000 W (2.25 PFLOP/s BF16, 8 TB/s HBM3e)", 2.25e15, 8e12),
    "a100": Device("A100 SXM 80 GB (312 TFLOP/s BF16, 2.04 TB/s HBM2e)", 312e12, 2.039e12),
    "cpu": Device("CPU, nominal server socket (2 TFLOP/s BF16 AMX, 0.3 TB/s DDR5)", 2e12,
                  0.3e12),
}
"""Roofline presets by name (``--pgq-device``)."""


def gemm_intensity(m: int, n: int, k: int, bytes_per_element: float = 2.0) -> float:
    """Arithmetic intensity (FLOP/byte) of one ``(m x k) @ (k x n)`` GEMM (module docstring)."""
    return 2.0 * m * n * k / (bytes_per_element * (m * k + k * n + m * n))


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
    """What the cost model needs to know about the model and the tokens it is charged for."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width ``h``."""
    ffn_hidden_size: int
    """MLP inner width (of each of gate and up for SwiGLU)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads."""
    swiglu: bool
    """Gated MLP: fc1 computes gate and up (twice the outputs)."""
    tokens: int
    """Tokens ``T`` the costs are for: a step's (global batch x sequence length) from
    :meth:`from_args`; a micro-batch's for per-micro-batch times."""
    pipeline_stages: int = 1
    """PP size."""
    layers_per_virtual_stage: int | None = None
    """Layers per virtual-pipeline chunk (interleaved schedule), or None."""
    seq_length: int = 0
    """Sequence length ``s``, the attention core's span (0: no attention-core time)."""
    vocab_size: int = 0
    """Output-layer width ``v``, the padded vocabulary (0: no output-layer time)."""

    @classmethod
    def from_args(cls, args) -> "ModelShape":
        """The run's shape for a whole step (``padded_vocab_size`` 0 until training sets it)."""
        return cls(args.num_layers, args.hidden_size, args.ffn_hidden_size,
                   args.num_attention_heads, args.num_query_groups, bool(args.swiglu),
                   args.global_batch_size * args.seq_length, args.pipeline_model_parallel_size,
                   args.num_layers_per_virtual_pipeline_stage, args.seq_length,
                   getattr(args, "padded_vocab_size", 0) or 0)

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


def layer_stages(shape: ModelShape, stage_of: list[int] | None = None) -> list[int]:
    """Pipeline stage of every layer: ``stage_of`` when given (an explicit split, e.g.
    megatron's uneven first / last stage, or the stages a dry run built), else
    ``shape.stage_of`` (the even split); ``ValueError`` for a split that does not fit."""
    if stage_of is None:
        return [shape.stage_of(layer) for layer in range(shape.num_layers)]
    if (len(stage_of) != shape.num_layers or
            not all(0 <= k < shape.pipeline_stages for k in stage_of)):
        raise ValueError(f"stage_of must give a stage in 0..{shape.pipeline_stages - 1} for "
                         f"each of the {shape.num_layers} layers, got {list(stage_of)}")
    return list(stage_of)


@dataclass(frozen=True)
class SiteCost:
    """One site's three GEMMs (fprop, dgrad, wgrad) under its formats, for ``shape.tokens``."""

    gemm_flops: float
    """FLOPs of each of the three GEMMs, ``2·T·N·K``."""
    classes: tuple[str, ...]
    """Precision class of each GEMM, in ``GEMM_ROLES`` order."""
    seconds: float
    """Time of the three on the device profile asked for: GEMMs plus the quantization of
    their operands (:mod:`~megatron_ext.precision.device_profile`)."""
    quantize_seconds: float = 0.0
    """The part of :attr:`seconds` spent quantizing operands."""

    @property
    def flops(self) -> float:
        """All three GEMMs' FLOPs."""
        return 3 * self.gemm_flops

    @property
    def fp4_flops(self) -> float:
        """FLOPs of the GEMMs that run at FP4 rate."""
        return self.classes.count("fp4") * self.gemm_flops


def device(profile: DeviceProfile | None = None,
           bf16_flops_per_s: float | None = None) -> DeviceProfile:
    """``profile`` (default ``nominal``) with its BF16 rate replaced when one is given."""
    profile = profile or PROFILES["nominal"]
    if bf16_flops_per_s is None:
        return profile
    return dataclasses.replace(profile, bf16_flops_per_s=bf16_flops_per_s)


def gemm_seconds(profile: DeviceProfile, flops: float, a: str, b: str, elements: tuple[int, int]
                 ) -> tuple[float, float]:
    """(total, quantization) seconds of one GEMM of ``flops`` reading operand formats ``a``
    and ``b`` of ``elements`` elements each, on ``profile`` (module docstring)."""
    rates = (profile.rate(a), profile.rate(b))
    grid = [(n, name) for n, name in zip(elements, (a, b)) if quantized(name)]
    if not grid:
        return flops / profile.bf16_flops_per_s, 0.0
    if None not in rates:
        quant = sum(n for n, _ in grid) * profile.quantize_s_per_element
        return flops / (profile.bf16_flops_per_s * min(rates)) + quant, quant
    quant = sum(n for n, _ in grid) * profile.emulate_s_per_element
    return flops / profile.bf16_flops_per_s + quant, quant


def site_cost(shape: ModelShape, site: str, formats: SiteFormats,
              bf16_flops_per_s: float | None = None,
              profile: DeviceProfile | None = None) -> SiteCost:
    """FLOPs, classes and time of ``site``'s GEMMs with ``formats`` on ``profile`` (default
    ``nominal``; ``bf16_flops_per_s`` replaces its BF16 rate)."""
    profile = device(profile, bf16_flops_per_s)
    n, k = shape.site_nk(site)
    t = shape.tokens
    gemm = 2.0 * t * n * k
    elements = {"x": t * k, "w": n * k, "dy": t * n}
    classes, seconds, quant = [], 0.0, 0.0
    for name, (a, b) in GEMM_ROLES.items():
        fa, fb = formats.operand(name, a), formats.operand(name, b)
        classes.append(gemm_class(fa, fb))
        total, q = gemm_seconds(profile, gemm, fa, fb, (elements[a], elements[b]))
        seconds, quant = seconds + total, quant + q
    return SiteCost(gemm, tuple(classes), seconds, quant)


def stage_fixed_seconds(shape: ModelShape, bf16_flops_per_s: float | None = None,
                        stage_of: list[int] | None = None,
                        profile: DeviceProfile | None = None) -> list[float]:
    """Per stage, the time no plan changes: ``6·T·s·h`` per layer (attention core) plus
    ``6·T·v·h`` on the last stage (output layer), in BF16, plus the profile's non-GEMM time
    of ``T`` tokens per layer; ``stage_of`` as in :func:`layer_stages`."""
    profile = device(profile, bf16_flops_per_s)
    flops, other = [0.0] * shape.pipeline_stages, [0.0] * shape.pipeline_stages
    for stage in layer_stages(shape, stage_of):
        flops[stage] += 3 * 2 * shape.tokens * shape.seq_length * shape.hidden_size
        other[stage] += shape.tokens * profile.nongemm_s_per_token_layer
    flops[-1] += 3 * 2 * shape.tokens * shape.vocab_size * shape.hidden_size
    return [f / profile.bf16_flops_per_s + o for f, o in zip(flops, other)]


def _site_costs(formats_of, shape: ModelShape, stage_of, profile: DeviceProfile):
    """(stage, SiteCost) of every site of the model; ``formats_of(site_id) -> SiteFormats``."""
    for layer, stage in enumerate(layer_stages(shape, stage_of)):
        for site in SITES:
            yield stage, site_cost(shape, site, formats_of(site_id(layer, site)),
                                   profile=profile)


def stage_seconds(formats_of, shape: ModelShape, bf16_flops_per_s: float | None = None,
                  stage_of: list[int] | None = None,
                  profile: DeviceProfile | None = None) -> list[float]:
    """Per stage: its sites' GEMM time under ``formats_of`` plus its fixed time, for
    ``shape.tokens`` tokens on one device running the whole stage (divide by TP)."""
    profile = device(profile, bf16_flops_per_s)
    gemms = [0.0] * shape.pipeline_stages
    for stage, cost in _site_costs(formats_of, shape, stage_of, profile):
        gemms[stage] += cost.seconds
    fixed = stage_fixed_seconds(shape, stage_of=stage_of, profile=profile)
    return [g + f for g, f in zip(gemms, fixed)]


@dataclass(frozen=True)
class FlopReport:
    """Linear-layer FLOPs per step, split by precision class, and their estimated time."""

    total: float
    """All linear-site GEMM FLOPs of a step (output layer and attention excluded)."""
    fractions: dict[str, float]
    """Class -> fraction of ``total``."""
    stage_fractions: list[dict[str, float]]
    """Per pipeline stage: class -> fraction of that stage's FLOPs."""
    stage_flops: list[float]
    """Per pipeline stage: its linear-site FLOPs."""
    time_vs_bf16: float
    """Estimated GEMM time (quantization included) relative to every GEMM in BF16, on the
    report's device profile."""
    profile: str = "nominal"
    """Name of the device profile the time is for."""

    def metrics(self) -> dict[str, float]:
        """Flat ``{"fp4_flop_frac": .., "fp4_flop_frac_stage0": .., ...}`` for logging."""
        out = {f"{c}_flop_frac": self.fractions[c] for c in CLASSES}
        if len(self.stage_fractions) > 1:
            for stage, fractions in enumerate(self.stage_fractions):
                out.update({f"{c}_flop_frac_stage{stage}": fractions[c] for c in CLASSES})
        out["gemm_time_vs_bf16"] = self.time_vs_bf16
        return out


def flop_report(formats_of, shape: ModelShape, stage_of: list[int] | None = None,
                profile: DeviceProfile | None = None) -> FlopReport:
    """Account every GEMM of every site; ``formats_of(site_id) -> SiteFormats``, ``stage_of``
    as in :func:`layer_stages`; the time on ``profile`` (default ``nominal``)."""
    profile = device(profile)
    stages = [dict.fromkeys(CLASSES, 0.0) for _ in range(shape.pipeline_stages)]
    seconds = bf16 = 0.0
    for stage, cost in _site_costs(formats_of, shape, stage_of, profile):
        seconds += cost.seconds
        bf16 += 3 * (cost.gemm_flops / profile.bf16_flops_per_s)  # site_cost's sum in BF16
        for cls in cost.classes:
            stages[stage][cls] += cost.gemm_flops
    totals = [sum(s.values()) for s in stages]
    total = sum(totals)
    fractions = {c: sum(s[c] for s in stages) / total for c in CLASSES}
    per_stage = [{c: s[c] / t for c in CLASSES} for s, t in zip(stages, totals)]
    return FlopReport(total, fractions, per_stage, totals, seconds / bf16, profile.name)
