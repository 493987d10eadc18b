"""GaussWS — Gaussian weight sampling (``shared/papers/002_*``): pseudo-quantization training
that adds FP-friendly noise to chosen weights, with a learnable bit width per 32 x 32 tile.

Numerics core, then the training wiring (``docs/gaussws.md``):

* :mod:`.noise` — R ≈ round(N(0,1)/2) from random bits (eq. 7-8), 16 bits per element
  from a counter-based generator (SplitMix64) so any slice of a weight's stream is
  generated on its own; the seed hierarchy run -> site -> step (:class:`NoiseSeeds`);
* :mod:`.layout` — tile geometry on the full weight, TP shards (:class:`ShardLayout`), tile
  maxima of a shard and their all-reduce MAX combine;
* :mod:`.sampling` — eq. 1-3 (:class:`GaussSample`, :func:`perturb`, :func:`bits_grad`),
  ŵ as a weight the quantized GEMM rebuilds in its backward (:func:`recomputable_sample`)
  and eq. 6's bound;
* :mod:`.weight` — eq. 9's b_i parameter per weight (:class:`GaussWSWeight`), eq. 10;
* :mod:`.flags` — :class:`GaussWSConfig` and the ``--gaussws*`` flags;
* :mod:`.triton_kernels` — the CUDA path (R generation; R generation + scaled add);
* :mod:`.attach` — b_i per sampled site, the operand transform returning ŵ, eq. 6 from the
  plan; :mod:`.extension` — ``gaussws_extension``: the hooks (eq. 10, metrics, checkpoint).
"""

from .flags import GaussWSConfig, add_arguments, parse_sites
from .layout import ShardLayout, all_reduce_block_amax, combine_block_amax, local_block_amax
from .noise import NoiseSeeds
from .sampling import (
    GaussSample,
    bits_grad,
    format_mantissa_bits,
    perturb,
    recomputable_sample,
    underflow_bound,
)
from .weight import GaussWSWeight, bitwidth_loss

__all__ = [
    "GaussSample",
    "GaussWSConfig",
    "GaussWSWeight",
    "NoiseSeeds",
    "ShardLayout",
    "add_arguments",
    "all_reduce_block_amax",
    "bits_grad",
    "bitwidth_loss",
    "combine_block_amax",
    "format_mantissa_bits",
    "local_block_amax",
    "parse_sites",
    "perturb",
    "recomputable_sample",
    "underflow_bound",
]
