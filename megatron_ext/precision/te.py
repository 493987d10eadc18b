"""Transformer Engine (TE): which sites TE can run natively, and running them.

A site whose three role formats are exactly one of TE's recipes runs its local GEMM through a
TE ``Linear`` under that recipe (per layer: each call opens its own autocast); every other
site, and every site on a machine without TE or without a capable GPU, runs the emulated
:class:`~megatron_ext.precision.gemm.QuantizedGemm`. TE is imported lazily and optionally:
this module imports on any machine.

Recipe table (``x``, ``w``, ``dy`` as ``megatron_ext.formats`` names; compute capability from
TE's support matrix, https://nvidia.github.io/TransformerEngine/support_matrix.html):

==========================  ==========  ================  =================  ==============
recipe (fp8 format)         x           w                 dy                 capability
==========================  ==========  ================  =================  ==============
Float8CurrentScaling E4M3   fp8_e4m3    fp8_e4m3          fp8_e4m3           >= 8.9
Float8CurrentScaling HYBRID fp8_e4m3    fp8_e4m3          fp8_e5m2           >= 8.9
Float8BlockScaling E4M3     ..@tile128  fp8_e4m3@block128 fp8_e4m3@tile128   >= 9.0
MXFP8BlockScaling E4M3      mxfp8       mxfp8             mxfp8              10.x
MXFP8BlockScaling HYBRID    mxfp8       mxfp8             mxfp8_e5m2         10.x
NVFP4BlockScaling E2M1      nvfp4       nvfp4             nvfp4+sr           10.x
==========================  ==========  ================  =================  ==============

(``fp8_e4m3`` alone is per-tensor scaling, TE's current scaling; ``..@tile128`` is
``fp8_e4m3@tile128``.) TE's NVFP4 recipe is the nearest match, not an identical one: it
scales weights in 16x16 blocks and applies a random Hadamard transform to wgrad operands,
where the emulated ``nvfp4`` weight uses 1x16 blocks. Sites with per-GEMM overrides never
run through TE (a TE recipe fixes all three GEMMs).

**Status: the execution path (:func:`te_linear`) has not been run** — this project's machine
has no GPU and TE cannot be installed. The selection logic (:func:`recipe_for`) is pure and
unit-tested.
"""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import NamedTuple

import torch

from megatron_ext.precision import recipe_export  # the one table of TE recipes


class TERecipe(NamedTuple):
    """A TE recipe: class name in ``transformer_engine.common.recipe`` and its format."""

    name: str
    """``Float8CurrentScaling``, ``Float8BlockScaling``, ``MXFP8BlockScaling`` or
    ``NVFP4BlockScaling``."""
    fmt: str
    """Member of ``transformer_engine.common.recipe.Format``: ``E4M3``, ``HYBRID``, ``E2M1``."""


@lru_cache(maxsize=None)
def recipe_for(formats, capability: tuple[int, int]) -> TERecipe | None:
    """The TE recipe that runs ``formats`` (a ``SiteFormats``) natively on a GPU of compute
    ``capability`` (e.g. ``(9, 0)`` for H100), or ``None``: emulate it."""
    recipe = recipe_export.recipe_for(formats)
    if recipe is None or recipe.te_class == "" or not recipe.runs_on(capability):
        return None
    return TERecipe(recipe.te_class, recipe.te_format)


@lru_cache(maxsize=1)
def te_pytorch():
    """``transformer_engine.pytorch``, or ``None`` when it is not importable."""
    try:
        import transformer_engine.pytorch as te_torch
    except Exception:  # not installed, or installed without a usable CUDA build
        return None
    return te_torch


def device_recipe(formats, x: torch.Tensor) -> TERecipe | None:
    """The recipe to run ``formats`` with for input ``x``: ``None`` unless ``x`` is on a CUDA
    device that supports one and TE is importable."""
    if not x.is_cuda:
        return None
    recipe = recipe_for(formats, torch.cuda.get_device_capability(x.device))
    return recipe if recipe is not None and te_pytorch() is not None else None


@lru_cache(maxsize=None)
def _recipe_object(recipe: TERecipe):
    from transformer_engine.common import recipe as te_recipe

    fmt = getattr(te_recipe.Format, recipe.fmt)
    key = "fp4_format" if recipe.name == "NVFP4BlockScaling" else "fp8_format"
    return getattr(te_recipe, recipe.name)(**{key: fmt})


def _autocast(recipe: TERecipe):
    te_torch = te_pytorch()
    if hasattr(te_torch, "autocast"):  # TE >= 2.8
        return te_torch.autocast(enabled=True, recipe=_recipe_object(recipe))
    return te_torch.fp8_autocast(enabled=True, fp8_recipe=_recipe_object(recipe))


_TE_LINEARS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _shared_linear(owner: torch.nn.Module, weight: torch.nn.Parameter):
    """A bias-free TE ``Linear`` whose weight *is* ``weight`` (kept outside ``owner``'s module
    tree, so state dicts and parameter lists do not change)."""
    linear = _TE_LINEARS.get(owner)
    if linear is None:
        linear = te_pytorch().Linear(weight.shape[1], weight.shape[0], bias=False,
                                     params_dtype=weight.dtype, device=weight.device)
        _TE_LINEARS[owner] = linear
    if linear.weight is not weight:
        linear.weight = weight
    return linear


def te_linear(owner: torch.nn.Module, x: torch.Tensor, weight: torch.nn.Parameter,
              bias: torch.Tensor | None, recipe: TERecipe) -> torch.Tensor:
    """``x @ weight.T + bias`` through TE under ``recipe`` (the local GEMM only: TP
    communication stays with the caller). Untested: see the module docstring."""
    with _autocast(recipe):
        out = _shared_linear(owner, weight)(x)
    return out if bias is None else out + bias
