"""Per-layer mixed precision: quantized linear GEMMs driven by a PrecisionPlan.

Importing the package gives the **value types** only (no torch.nn, no megatron-core):
:class:`PrecisionPlan`, :class:`SiteFormats`, :func:`load_plan`, :func:`save_plan`. The
machinery lives in its modules, layered (``.importlinter``, contract ``precision-layers``):

* :mod:`.site_formats`, :mod:`.plan` — site formats and the plan (JSON, hash): values;
* :mod:`.cost` — FLOP accounting by precision class, overall and per pipeline stage;
* :mod:`.gemm`, :mod:`.real_gemm`, :mod:`.recipe_export`, :mod:`.te`, :mod:`.layers` — the
  quantized GEMM (emulated, and real FP8), the TE recipe table, quantized megatron
  ``Column/RowParallelLinear`` and ``apply_plan``;
* :mod:`.observe` — observed passes;
* :mod:`.controller` — base plan + overlays, ``verify_same_plan`` across ranks;
* :mod:`.policies` — plans from flags (``uniform:bf16|fp8|fp4|fp4-tensor|<format>``, keep
  first/last layers);
* :mod:`.dry_run`, :mod:`.extension` — the training Extension (``precision_extension()``).

See ``docs/precision.md``.
"""

from megatron_ext.precision.plan import PrecisionPlan, load_plan, save_plan
from megatron_ext.precision.site_formats import SiteFormats

__all__ = ["PrecisionPlan", "SiteFormats", "load_plan", "save_plan"]
