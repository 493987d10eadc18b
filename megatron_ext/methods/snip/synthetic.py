"""Synthetic SNIP problems for a Llama shape: real FLOPs and times, random quality losses.

Used by the tests and ``benchmarks/ilp.py``. Each site ``L{i}.{qkv|proj|fc1|fc2}`` runs
three GEMMs of ``2·T·N·K`` FLOPs each (fprop reads x, w; dgrad dy, w; wgrad dy, x). An
option puts a subset of the roles {x, w, dy} in FP4 and the rest in FP8; a GEMM runs in FP4
only when both of its operands are FP4 (a GEMM runs at its wider operand's rate), so

    FP4 roles     FP4 GEMMs        fp4_flops / flops
    none          -                0      ("fp8")
    x, w, dy      all three        1      ("fp4")
    two roles     the one reading  1/3    ("fp4:x+w", "fp4:w+dy", "fp4:x+dy")
    one role      none             0      ("fp4:x", "fp4:w", "fp4:dy": dominated by "fp8")

Times use FP8 = 2 x BF16 and FP4 = 2 x FP8 throughput (H100-like dense BF16 rate). Each
stage's fixed time holds what no option changes: the attention core (BF16) of its layers,
plus the output layer and loss (BF16) on the last stage. ``q`` of an option is a small
FP8 floor plus, per role run in FP4, a log-normal per-site sensitivity (first and last
layers and ``fc2`` drawn more sensitive), with 10% noise per option.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_ext.methods.snip.problem import Option, Problem, Site
from megatron_ext.sites import SITES

BF16_FLOPS_PER_S = 989e12
"""Dense BF16 tensor-core rate (H100 SXM); FP8 is 2x, FP4 4x."""

_OPTION_ROLES = ((), ("x", "w", "dy"), ("x", "w"), ("w", "dy"), ("x", "dy"),
                 ("x",), ("w",), ("dy",))
_GEMMS = (("x", "w"), ("dy", "w"), ("dy", "x"))


@dataclass(frozen=True)
class LlamaShape:
    """What FLOPs and times need from a Llama-style model."""

    hidden: int
    """Model width."""
    ffn: int
    """SwiGLU inner width (fc1 computes gate and up: 2 x ffn outputs)."""
    heads: int
    """Query heads."""
    groups: int
    """Key/value heads (GQA groups)."""
    vocab: int
    """Vocabulary (output layer size)."""
    seq: int
    """Sequence length; tokens per step T = seq x micro_batch."""
    micro_batch: int = 1
    """Sequences per micro-batch (times are per micro-batch)."""

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    def site_nk(self, site: str) -> tuple[int, int]:
        """(N, K) of a site's weight."""
        head_dim = self.hidden // self.heads
        return {"qkv": (self.hidden + 2 * self.groups * head_dim, self.hidden),
                "proj": (self.hidden, self.hidden),
                "fc1": (2 * self.ffn, self.hidden),
                "fc2": (self.hidden, self.ffn)}[site]


SHAPES = {
    "llama3-70b": LlamaShape(hidden=8192, ffn=28672, heads=64, groups=8, vocab=128256, seq=8192),
    "llama3-8b": LlamaShape(hidden=4096, ffn=14336, heads=32, groups=8, vocab=128256, seq=8192),
    "tinyllama": LlamaShape(hidden=2048, ffn=5632, heads=32, groups=4, vocab=32000, seq=2048),
}


def stage_of_layers(num_layers: int, stages: int) -> list[int]:
    """Stage of each layer: contiguous blocks, the first ``num_layers % stages`` stages one
    layer longer (TinyLlama's 22 layers on 4 stages: 6, 6, 5, 5)."""
    return [int(k) for k, block in enumerate(np.array_split(np.arange(num_layers), stages))
            for _ in block]


def _fixed_times(shape: LlamaShape, stage_of: list[int], stages: int) -> list[float]:
    t = shape.tokens
    attention = 3 * 2 * t * shape.seq * shape.hidden  # QK^T and PV, causal half, fwd + bwd
    output = 3 * 2 * t * shape.vocab * shape.hidden
    flops = [0.0] * stages
    for k in stage_of:
        flops[k] += attention
    flops[-1] += output
    return [f / BF16_FLOPS_PER_S for f in flops]


def synthetic_problem(num_layers: int, sites_per_layer: int = 4, options: int = 8,
                      stages: int = 1, seed: int = 0, shape: str | LlamaShape = "llama3-70b"
                      ) -> Problem:
    """A problem for ``num_layers`` layers of ``shape`` split into ``stages``; the first
    ``sites_per_layer`` sites of (qkv, proj, fc1, fc2) and the first ``options`` options of
    (fp8, fp4, fp4:x+w, fp4:w+dy, fp4:x+dy, fp4:x, fp4:w, fp4:dy) per site."""
    if not 1 <= sites_per_layer <= len(SITES):
        raise ValueError(f"sites_per_layer must be 1..{len(SITES)}, got {sites_per_layer}")
    if not 1 <= options <= len(_OPTION_ROLES):
        raise ValueError(f"options must be 1..{len(_OPTION_ROLES)}, got {options}")
    if not 1 <= stages <= num_layers:
        raise ValueError(f"stages must be 1..num_layers, got {stages}")
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    rng = np.random.default_rng(seed)
    stage_of = stage_of_layers(num_layers, stages)
    sites = []
    for layer in range(num_layers):
        edge = 3.0 if layer in (0, num_layers - 1) else 1.0
        for name in SITES[:sites_per_layer]:
            n, k = shape.site_nk(name)
            gemm = 2.0 * shape.tokens * n * k
            scale = edge * (2.0 if name == "fc2" else 1.0)
            sens = dict(zip(("x", "w", "dy"), scale * rng.lognormal(0.0, 1.0, 3)))
            floor = 0.01 * rng.random()
            opts = []
            for roles in _OPTION_ROLES[:options]:
                fp4 = sum(set(g) <= set(roles) for g in _GEMMS)
                q = floor + sum(sens[r] for r in roles) * (1 + 0.1 * rng.standard_normal())
                opts.append(Option(
                    name="fp8" if not roles else "fp4" if len(roles) == 3
                    else "fp4:" + "+".join(roles),
                    q=float(q), fp4_flops=fp4 * gemm, flops=3 * gemm,
                    time=(fp4 / 4 + (3 - fp4) / 2) * gemm / BF16_FLOPS_PER_S))
            sites.append(Site(f"L{layer}.{name}", stage_of[layer], tuple(opts)))
    return Problem(tuple(sites), stages, tuple(_fixed_times(shape, stage_of, stages)),
                   meta={"synthetic": {"num_layers": num_layers, "seed": seed,
                                       "sites_per_layer": sites_per_layer, "options": options}})
