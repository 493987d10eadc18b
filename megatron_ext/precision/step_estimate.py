"""A step's estimated time, part by part, and the non-GEMM part measured from a BF16 step.

The cost model's estimate of one training step on one device (the whole model, no pipeline
or tensor parallelism) is the sum of four parts (docs/cost_model.md):

* ``gemm_s``: the linear GEMMs (fprop, dgrad, wgrad of qkv, proj, fc1, fc2) at their formats'
  rates on the device profile (emulated formats at BF16's);
* ``quantize_s``: quantizing (and, emulated, dequantizing) their operands;
* ``fixed_s``: the attention core and the output layer, in BF16;
* ``other_s``: everything else (norms, elementwise, optimizer, host), the profile's
  ``nongemm_s_per_token_layer`` x tokens x layers — 0 until :func:`calibrate` sets it from a
  measured BF16 step.

:func:`calibrate` makes the BF16 estimate equal a measured BF16 step by construction; what a
GPU run then checks is the estimate of every other plan (FP8, SNIP's, PGQ's) against its
measured step (target: within 15 %).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ext.precision.cost import ModelShape, site_cost, stage_fixed_seconds
from megatron_ext.precision.device_profile import DeviceProfile, checked
from megatron_ext.precision.site_formats import SiteFormats
from megatron_ext.sites import SITES, site_id


@dataclass(frozen=True)
class StepEstimate:
    """One step's estimated seconds by part, on one device running the whole model."""

    gemm_s: float
    """Linear GEMMs at their formats' rates (quantization excluded)."""
    quantize_s: float
    """Quantizing (and for emulated formats dequantizing) the GEMMs' operands."""
    fixed_s: float
    """Attention core and output layer, in BF16."""
    other_s: float
    """The profile's non-GEMM time (0 unless calibrated)."""
    profile: str
    """Name of the device profile."""

    @property
    def total_s(self) -> float:
        """The step: the sum of the four parts."""
        return self.gemm_s + self.quantize_s + self.fixed_s + self.other_s

    def to_dict(self) -> dict:
        """JSON form, ``total_s`` included."""
        return {**dataclasses.asdict(self), "total_s": self.total_s}


def step_estimate(formats_of, shape: ModelShape, profile: DeviceProfile) -> StepEstimate:
    """The step of ``shape.tokens`` tokens under ``formats_of(site_id) -> SiteFormats`` (a
    plan's ``formats``) on ``profile``, by part (module docstring)."""
    whole = dataclasses.replace(shape, pipeline_stages=1, layers_per_virtual_stage=None)
    gemm = quantize = 0.0
    for layer in range(shape.num_layers):
        for site in SITES:
            cost = site_cost(whole, site, formats_of(site_id(layer, site)), profile=profile)
            gemm += cost.seconds - cost.quantize_seconds
            quantize += cost.quantize_seconds
    fixed = stage_fixed_seconds(whole, profile=dataclasses.replace(
        profile, nongemm_s_per_token_layer=0.0))[0]
    other = profile.nongemm_s_per_token_layer * shape.tokens * shape.num_layers
    return StepEstimate(gemm, quantize, fixed, other, profile.name)


def calibrate(profile: DeviceProfile, shape: ModelShape, bf16_step_s: float) -> DeviceProfile:
    """``profile`` with ``nongemm_s_per_token_layer`` set so that the BF16 step of ``shape``
    (``shape.tokens`` a step) is estimated at the measured ``bf16_step_s`` (never below 0)."""
    base = step_estimate(lambda sid: SiteFormats(), shape,
                         dataclasses.replace(profile, nongemm_s_per_token_layer=0.0))
    rest = max(0.0, bf16_step_s - base.total_s) / (shape.tokens * shape.num_layers)
    return checked(dataclasses.replace(
        profile, nongemm_s_per_token_layer=rest,
        source=f"{profile.source}; non-GEMM time from a measured BF16 step of "
               f"{bf16_step_s * 1e3:.1f} ms"))
