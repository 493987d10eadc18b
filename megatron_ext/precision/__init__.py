"""Per-layer mixed precision: quantized linear GEMMs driven by a PrecisionPlan.

* :mod:`.sites` — site ids (``L{i}.{qkv|proj|fc1|fc2}``), roles, :class:`SiteFormats`;
* :mod:`.gemm` — the quantized GEMM autograd function (the math: which axis each operand is
  quantized along in each GEMM);
* :mod:`.layers` — quantized megatron ``Column/RowParallelLinear`` for the layer specs;
* :mod:`.plan` — :class:`PrecisionPlan`: JSON, hash, apply to a model, cross-rank check;
* :mod:`.cost` — FLOP accounting by precision class, overall and per pipeline stage;
* :mod:`.policies` — plans from flags (``uniform:bf16|fp8|fp4|fp4-tensor|<format>``, keep
  first/last layers);
* :mod:`.extension` — the training Extension (``precision_extension()``).

See ``docs/precision.md``.
"""

from megatron_ext.precision.extension import precision_extension
from megatron_ext.precision.plan import PrecisionPlan, load_plan
from megatron_ext.precision.sites import SiteFormats

__all__ = ["PrecisionPlan", "SiteFormats", "load_plan", "precision_extension"]
