"""Quantized megatron-core linears: ``ColumnParallelLinear`` / ``RowParallelLinear`` whose local
GEMM runs through :class:`~megatron_ext.precision.gemm.QuantizedGemm`.

Only megatron's ``_forward_impl`` (the local GEMM with its fused TP communication) is replaced;
everything around it — weight sharding, init, ``sharded_state_dict``, the column layer's
output gather and the row layer's all-reduce / reduce-scatter — is megatron's own code. The
communication that megatron fuses into its GEMM function is done with megatron's mappings, the
same collectives in the same places:

* TP without sequence parallelism (column layer): ``copy_to_tensor_model_parallel_region`` —
  identity forward, all-reduce of ``dx`` backward;
* sequence parallelism (column layer): ``gather_from_sequence_parallel_region`` — all-gather
  of ``x`` along the sequence forward, reduce-scatter of ``dx`` backward. Like megatron's
  own linear, the quantized function keeps only this rank's rows of what wgrad reads (``x``,
  or its quantized copy) and all-gathers them again in the backward: a layer keeps
  ``s·b·h/t`` of its input, not ``s·b·h``.

A site's formats are the mutable attribute ``formats`` (a
:class:`~megatron_ext.precision.site_formats.SiteFormats`, passthrough at build), read on every call:
switching formats between steps rebuilds nothing. With every operand passthrough the call goes
to megatron's own ``_forward_impl``, so such a site *is* megatron's linear — unless an operand
transform returned a :class:`~.gemm.RecomputableWeight`: then the quantized GEMM with
passthrough operands runs, which keeps the weight's source instead of the transformed weight. On a GPU with
Transformer Engine, a site whose formats TE runs natively goes through TE
(:mod:`megatron_ext.precision.te`) unless the class was built with ``te_allowed=False``.
"""

from __future__ import annotations

from functools import lru_cache

from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_ext.precision import te
from megatron_ext.precision.gemm import RecomputableWeight, quantized_gemm
from megatron_ext.precision.real_gemm import wants_real
from megatron_ext.sites import COLUMN_SITES, SITES, parse_site_id, site_id
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.site_formats import SiteFormats, resolve
from megatron_ext.precision.weight_cache import WeightCache, WeightReuse


class QuantizedLinear:
    """Mixin placed before a megatron linear class; the subclass knows its site."""

    site_id: str = ""
    """``L{i}.{site}`` of this class (set by :func:`quantized_class`)."""
    te_allowed: bool = True
    """Whether natively supported formats may run through Transformer Engine."""
    own_input: bool = True
    """Whether the GEMM's input is its alone (False for ``proj``: fused attention keeps its
    output for its own backward), so that a quantized copy may be kept in its place."""
    fp8_execution: str = "emulated"
    """``--fp8-execution``: ``auto``, ``real`` or ``emulated`` (:func:`.real_gemm.wants_real`)."""
    observer = None
    """During an observed pass (:mod:`.observe`): the callable that runs instead of the GEMM."""
    weight_cache = None
    """A :class:`~.weight_cache.WeightCache` while weights are quantized once per step
    (:func:`cache_weights`), else None."""
    transforms: tuple = ()
    """Operand transforms, ``transform(module, input, weight) -> (input, weight)``, applied in
    order before the GEMM (a method's weight perturbation: the plan then quantizes the result);
    set per module with :func:`add_transform`. A transform may return the weight as a
    :class:`~.gemm.RecomputableWeight`: the quantized GEMM then keeps the source and rebuilds
    the transformed weight in its backward (the next transform, an observer or Transformer
    Engine get its ``value``, and keep what they keep)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.gradient_accumulation_fusion:
            raise ValueError(f"{self.site_id}: quantized linears do not support "
                             "gradient_accumulation_fusion (turn it off)")
        self.formats = SiteFormats()

    def _forward_impl(self, input, weight, **kwargs):
        for transform in self.transforms:
            input, weight = transform(self, input, _value(weight))
        if self.observer is not None:  # an observed pass (megatron_ext.precision.observe)
            return self.observer(self, input, _value(weight), kwargs)
        ops = resolve(self.formats)
        recomputable = isinstance(weight, RecomputableWeight)
        if ops.passthrough and not recomputable:  # else the GEMM below, to rebuild ŵ
            return super()._forward_impl(input=input, weight=weight, **kwargs)
        input = tp_input(input, kwargs)
        recipe = (te.device_recipe(self.formats, input)
                  if self.te_allowed and not ops.passthrough else None)
        if recipe is not None:
            return te.te_linear(self, input, _value(weight), kwargs["bias"], recipe)
        real = wants_real(self.fp8_execution, input.device)
        cache = self.weight_cache if weight is self.weight else None  # not a transform's ŵ
        if cache is not None:
            cache.start_forward()
        # the layer's own group: megatron hands the row layer's GEMM tp_group=None (it reduces
        # the output itself), but a tensor-wide scale needs the amax of every shard
        return quantized_gemm(input, weight, kwargs["bias"], ops, self.tp_group, real, cache,
                              self.own_input, sequence_group(kwargs))


def _value(weight):
    """The weight tensor of a transform's output (a :class:`RecomputableWeight`'s value)."""
    return weight.value if isinstance(weight, RecomputableWeight) else weight


def tp_input(input, kwargs: dict):
    """The GEMM's input: megatron's TP mapping of the module input (see the module docstring)."""
    group = kwargs["tp_group"]
    if kwargs["allreduce_dgrad"]:
        input = copy_to_tensor_model_parallel_region(input, group=group)
    if kwargs["sequence_parallel"]:
        input = gather_from_sequence_parallel_region(input, True, group=group)
    return input


def sequence_group(kwargs: dict):
    """The group :func:`tp_input` gathered the input over along the sequence (sequence
    parallelism), else None: the GEMM keeps only this rank's rows for its backward."""
    return kwargs["tp_group"] if kwargs["sequence_parallel"] else None


def tp_group():
    """megatron's tensor-parallel group when it has several ranks, else None: the group
    observed passes take tensor-wide scales over, as the GEMM does with its layer's group."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


@lru_cache(maxsize=None)
def quantized_class(base: type, layer: int, site: str, te_allowed: bool = True,
                    fp8_execution: str = "emulated") -> type:
    """``base`` (a megatron linear class) with its GEMM quantized, labelled ``L{layer}.{site}``."""
    name = f"Quantized{base.__name__}"
    return type(name, (QuantizedLinear, base),
                {"site_id": site_id(layer, site), "te_allowed": te_allowed,
                 "fp8_execution": fp8_execution, "own_input": site != "proj",
                 "__module__": __name__, "__qualname__": name})


def quantized_linear_classes(te_allowed: bool = True, fp8_execution: str = "emulated"):
    """A ``linear_classes`` callback for ``training.model.layer_spec``: every site quantized."""
    def classes(layer: int, site: str) -> type:
        base = ColumnParallelLinear if site in COLUMN_SITES else RowParallelLinear
        return quantized_class(base, layer, site, te_allowed, fp8_execution)

    return classes


def quantized_linears(model) -> dict[str, QuantizedLinear]:
    """``site id -> module`` for every quantized linear in ``model`` (a module or a list of
    chunks, DDP-wrapped or not)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    found = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, QuantizedLinear):
                if module.site_id in found:
                    raise RuntimeError(f"two linears claim site {module.site_id}")
                found[module.site_id] = module
    return found


def cache_weights(model, reuse: WeightReuse | None) -> None:
    """Give every quantized linear of ``model`` its own :class:`~.weight_cache.WeightCache`
    of ``reuse`` (None: no cache, every forward quantizes its weight)."""
    for module in quantized_linears(model).values():
        module.weight_cache = WeightCache(reuse) if reuse is not None else None


def add_transform(model, sites, transform) -> None:
    """Append ``transform`` to the operand transforms of ``model``'s ``sites`` (ids)."""
    linears = quantized_linears(model)
    for sid in sites:
        linears[sid].transforms = (*linears[sid].transforms, transform)


def apply_plan(model, plan: PrecisionPlan, num_layers: int) -> int:
    """Set every quantized linear of ``model`` (this rank's chunks) to its formats in
    ``plan``; returns how many were set. Every local layer must have all four sites."""
    plan.check_model(num_layers)
    linears = quantized_linears(model)
    layers = {parse_site_id(sid)[0] for sid in linears}
    missing = [site_id(layer, s) for layer in sorted(layers) for s in SITES
               if site_id(layer, s) not in linears]
    if missing:
        raise RuntimeError(f"model has no quantized linear for site(s) {missing}")
    for sid, module in linears.items():
        module.formats = plan.formats(sid)
    return len(linears)
