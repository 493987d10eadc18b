"""A PrecisionPlan as megatron-core's per-module Transformer Engine recipe (YAML).

megatron-core (0.16: ``megatron/core/quantization/quant_config.py``, Megatron-LM flag
``--te-precision-config-file``, or ``TransformerConfig.quant_recipe``) lets each TE linear
run under its own TE recipe. The YAML has two parts::

    configs:                      # how: name -> TEQuantizationParams payload
      fp8_blockwise:
        transformer_engine_config_type: TEQuantizationParams
        training_recipe: {fp8_quantization_recipe: blockwise, fp8_format: e4m3, ...}
    matchers:                     # which: ordered globs on the module path, first match wins
      layers.0.qkv: {config: fp8_blockwise, type: glob, enabled: true,
                     pattern: decoder.layers.0.self_attention.linear_qkv}

``GPTModel.__init__`` resolves it **once**: every module with ``finish_init`` (TE's linears)
gets the payload of the first matcher that fits its path from ``model.named_modules()``,
and opens that recipe's autocast on every forward. Two facts shape the export:

* a TE recipe fixes all three operands of all three GEMMs of a module, so a site is
  expressible only when its ``(x, w, dy)`` formats are exactly one recipe's (the table
  :data:`RECIPES`, read from megatron-core 0.16.1 and TE 2.9-2.11's recipe sources) or all
  unquantized (``bf16`` / ``none``: the BF16 GEMM of a BF16 run);
* the module path holds the layer's index **within its model chunk** (``decoder.layers`` is
  a ModuleList per pipeline stage / virtual stage), so under pipeline parallelism global
  layers ``j``, ``j + C``, ``j + 2C``, ... (``C`` layers per chunk) share one path: they get
  one recipe, and the sites whose plan differs there run in BF16 and are listed.

Every site that does not get the recipe its plan asks for runs unquantized (``bf16``) in the
export and is listed with the reason (:attr:`SiteExport.reason`); a final ``*`` matcher
keeps every other TE module (sites absent from the plan, anything that is not one of our
sites) unquantized too, as the plan means them. Each config sets both of megatron's override
flags, so the recipe holds whether or not a global ``--fp8-format`` / ``--fp4-format`` is on.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

import yaml
from megatron.core.enums import Fp4Recipe, Fp8Recipe

from megatron_ext.formats import get_format
from megatron_ext.io import write_text_atomic
from megatron_ext.precision.plan import PrecisionPlan
from megatron_ext.precision.site_formats import PASSTHROUGH, SiteFormats
from megatron_ext.sites import ROLES, SITES, parse_site_id, site_id

MODULES = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
           "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}
"""Site -> its module path inside a megatron ``TransformerLayer`` (TE and local specs alike)."""

_CONFIG_TYPE = {"transformer_engine_config_type": "TEQuantizationParams"}
_OVERRIDES = {"override_quantized_autocast": True, "override_nonquantized_autocast": True}
_FALLBACK_MATCHER = "everything_else"


@dataclass(frozen=True)
class TERecipe:
    """One recipe a megatron-core per-module config can select, and the site formats it runs."""

    key: str
    """Its name under ``configs:`` in the YAML."""
    formats: tuple[str, str, str] | None
    """``(x, w, dy)`` format names it quantizes with; ``None`` for the unquantized entry."""
    fields: tuple[tuple[str, str], ...]
    """megatron-core ``TEQuantizationRecipe`` fields that select it (the overrides come on top)."""
    te_class: str
    """The TE recipe class megatron builds from it (``transformer_engine.common.recipe``:
    ``Float8CurrentScaling``, ``Float8BlockScaling``, ``MXFP8BlockScaling``,
    ``NVFP4BlockScaling``; '' for the unquantized entry)."""
    te_format: str
    """Its ``transformer_engine.common.recipe.Format``: ``E4M3``, ``HYBRID``, ``E2M1``."""
    capability: tuple[int, int] | int | None
    """GPUs TE runs it on (TE's support matrix): a minimum compute capability ``(major,
    minor)``, or an int: exactly that major version (Blackwell data-centre, 10); None: any."""
    differs: str = ""
    """How TE's defaults differ from our emulation of the formats ('' if none is known)."""
    env: tuple[str, ...] = ()
    """Environment settings (read when TE is imported) that remove those differences."""

    @property
    def te_recipe(self) -> str:
        """``Float8BlockScaling(E4M3)``, or what the unquantized entry means."""
        return (f"{self.te_class}({self.te_format})" if self.te_class else
                "no quantization (BF16 GEMMs)")

    @property
    def gpus(self) -> str:
        if self.capability is None:
            return "any"
        if isinstance(self.capability, int):
            return f"sm {self.capability}.x"
        return f"sm >= {self.capability[0]}.{self.capability[1]}"

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Whether TE runs it on a GPU of compute ``capability``."""
        if self.capability is None or isinstance(self.capability, tuple):
            return capability >= (self.capability or (0, 0))
        return capability[0] == self.capability


def _fp8(recipe: Fp8Recipe, fmt: str) -> tuple[tuple[str, str], ...]:
    return (("fp8_quantization_recipe", recipe.value), ("fp8_format", fmt))


_POW2 = "TE's block scales are powers of two by default, ours float32"
_NVFP4 = ("TE scales weights in 16x16 blocks and Hadamard-transforms the wgrad operands, "
          "ours: 1x16 blocks, no transform")
_FP8_BLOCK = ("fp8_e4m3@tile128", "fp8_e4m3@block128")

HIGH_PRECISION = TERecipe("bf16", None, (), "", "", None)
"""Unquantized: megatron forces TE's autocast off for the module."""

RECIPES = (
    TERecipe("fp8_tensorwise", ("fp8_e4m3", "fp8_e4m3", "fp8_e4m3"),
             _fp8(Fp8Recipe.tensorwise, "e4m3"), "Float8CurrentScaling", "E4M3", (8, 9)),
    TERecipe("fp8_tensorwise_hybrid", ("fp8_e4m3", "fp8_e4m3", "fp8_e5m2"),
             _fp8(Fp8Recipe.tensorwise, "hybrid"), "Float8CurrentScaling", "HYBRID", (8, 9)),
    TERecipe("fp8_blockwise", (*_FP8_BLOCK, "fp8_e4m3@tile128"),
             _fp8(Fp8Recipe.blockwise, "e4m3"), "Float8BlockScaling", "E4M3", (9, 0),
             _POW2, ("NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1",)),
    TERecipe("fp8_blockwise_hybrid", (*_FP8_BLOCK, "fp8_e5m2@tile128"),
             _fp8(Fp8Recipe.blockwise, "hybrid"), "Float8BlockScaling", "HYBRID", (9, 0),
             _POW2, ("NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1",)),
    TERecipe("mxfp8", ("mxfp8", "mxfp8", "mxfp8"),
             _fp8(Fp8Recipe.mxfp8, "e4m3"), "MXFP8BlockScaling", "E4M3", 10),
    TERecipe("mxfp8_hybrid", ("mxfp8", "mxfp8", "mxfp8_e5m2"),
             _fp8(Fp8Recipe.mxfp8, "hybrid"), "MXFP8BlockScaling", "HYBRID", 10),
    TERecipe("nvfp4", ("nvfp4", "nvfp4", "nvfp4+sr"),
             (("fp4_quantization_recipe", Fp4Recipe.nvfp4.value),), "NVFP4BlockScaling",
             "E2M1", 10, _NVFP4,
             ("NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1", "NVTE_NVFP4_DISABLE_RHT=1")),
)
"""Every TE recipe a site can map to. Not here: TE's ``DelayedScaling`` (megatron-core refuses
it per module; no format of ours keeps an amax history) and ``custom`` recipes (they need a
quantizer factory importable on the training machine)."""

_BY_KEY = {r.key: r for r in (HIGH_PRECISION, *RECIPES)}


def _fmt(name: str):
    """The :class:`~megatron_ext.formats.Format` of a name; ``None`` for ``none``."""
    return None if name == PASSTHROUGH else get_format(name)


def _unquantized(name: str) -> bool:
    return _fmt(name) in (None, get_format("bf16"))


def _changed_overrides(formats: SiteFormats) -> dict[str, str]:
    """The per-GEMM overrides that give an operand another format than its role's."""
    return {op: fmt for op, fmt in formats.overrides
            if _fmt(fmt) != _fmt(getattr(formats, op.split(".")[1]))}


def recipe_for(formats: SiteFormats) -> TERecipe | None:
    """The recipe that runs ``formats`` as planned (:data:`HIGH_PRECISION` for an
    unquantized site), or ``None`` when no TE recipe does (see :func:`why_not`)."""
    names = tuple(getattr(formats, role) for role in ROLES)
    if _changed_overrides(formats):
        return None
    if all(_unquantized(n) for n in names):
        return HIGH_PRECISION
    if any(_unquantized(n) for n in names):
        return None
    wanted = tuple(get_format(n) for n in names)
    return next((r for r in RECIPES if tuple(map(get_format, r.formats)) == wanted), None)


def why_not(formats: SiteFormats) -> str:
    """One line: why no TE recipe runs ``formats`` (for a site :func:`recipe_for` refuses)."""
    changed = _changed_overrides(formats)
    if changed:
        pairs = ", ".join(f"{op} {fmt}" for op, fmt in changed.items())
        return f"per-GEMM overrides ({pairs}): a TE recipe gives a role one format in every GEMM"
    names = {role: getattr(formats, role) for role in ROLES}
    plain = [role for role, name in names.items() if _unquantized(name)]
    if plain:
        return (f"{', '.join(plain)} unquantized but not the rest: a TE recipe quantizes all "
                "three operands or none")
    shape = [(f.element, f.scaling) for f in map(get_format, names.values())]
    for recipe in RECIPES:
        if [(f.element, f.scaling) for f in map(get_format, recipe.formats)] == shape:
            sr = [r for r, f in zip(ROLES, recipe.formats) if get_format(f).stochastic]
            near = ", ".join(r for r in ROLES if r not in sr)
            how = (f"{', '.join(sr)} stochastically, {near} to nearest" if sr else
                   "every operand to nearest")
            return f"rounding: TE's {recipe.te_recipe} rounds {how}"
    bits = sorted({f.bits for f in map(get_format, names.values())})
    if len(bits) > 1:
        return (f"mixes {'- and '.join(map(str, bits))}-bit operands: a TE recipe quantizes "
                "x, w and dy to one width")
    return "no TE recipe has these formats (the recipes: docs/export_plan.md)"


def module_path(layer_in_chunk: int, site: str) -> str:
    """``decoder.layers.3.mlp.linear_fc1``: the path megatron matches a site's recipe on."""
    return f"decoder.layers.{layer_in_chunk}.{MODULES[site]}"


@dataclass(frozen=True)
class SiteExport:
    """What one site of the plan becomes in the recipe."""

    site: str
    """Global site id ``L{i}.{site}``."""
    formats: SiteFormats
    """Its formats in the plan."""
    module_path: str
    """The module path its recipe is matched on (layer index within its model chunk)."""
    config: str
    """The ``configs:`` key it gets."""
    reason: str
    """Why ``config`` is not what the plan asks for; '' when it is."""


@dataclass(frozen=True)
class RecipeExport:
    """A plan's recipe: one entry per exported site, in plan order."""

    plan: PrecisionPlan
    """The plan exported."""
    layers_per_chunk: int | None
    """Layers per model chunk under a pipeline split; ``None``: no split."""
    sites: tuple[SiteExport, ...]
    """Every site of the model (when the layer count was given), else every site in the plan."""

    def unexpressed(self) -> list[SiteExport]:
        """The sites that do not get the recipe their plan asks for (they run in BF16)."""
        return [s for s in self.sites if s.reason]

    def to_dict(self) -> dict:
        """The YAML content: ``configs`` (those used, plus ``bf16``) and ordered ``matchers``."""
        slots = {s.module_path: s.config for s in self.sites if s.config != HIGH_PRECISION.key}
        used = {HIGH_PRECISION.key, *slots.values()}
        configs = {r.key: {**_CONFIG_TYPE, "training_recipe": {**dict(r.fields), **_OVERRIDES}}
                   for r in (HIGH_PRECISION, *RECIPES) if r.key in used}
        matchers = {path: _glob(path, key) for path, key in slots.items()}
        matchers[_FALLBACK_MATCHER] = _glob("*", HIGH_PRECISION.key)
        return {"configs": configs, "matchers": matchers}

    def to_yaml(self) -> str:
        """:meth:`to_dict` as YAML (matcher order kept), :func:`report` as a comment on top."""
        # split first: a line break in the plan's method must not end the comment
        lines = [part for line in report(self) for part in line.splitlines()]
        header = "".join(f"# {line}\n" for line in lines)
        return header + yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


def _glob(pattern: str, config: str) -> dict:
    return {"config": config, "type": "glob", "pattern": pattern, "enabled": True}


def export_plan(plan: PrecisionPlan, num_layers: int | None = None,
                layers_per_chunk: int | None = None) -> RecipeExport:
    """Map every site of ``plan`` (of all ``num_layers`` layers, when given) to a recipe.

    ``layers_per_chunk`` below ``num_layers`` (a pipeline / virtual pipeline split) folds
    global layer ``g`` onto path index ``g % layers_per_chunk``; a path whose sites want
    different recipes runs in BF16. ``ValueError`` for sites outside ``num_layers``, or a
    split without ``num_layers``."""
    if num_layers is None:
        if layers_per_chunk is not None:
            raise ValueError("a pipeline split needs the model's layer count")
        sids = list(plan.sites)
    else:
        plan.check_model(num_layers)
        sids = [site_id(layer, s) for layer in range(num_layers) for s in SITES]
    chunk = layers_per_chunk if layers_per_chunk and layers_per_chunk < num_layers else None
    wanted, reasons, paths = {}, {}, {}
    for sid in sids:
        recipe = recipe_for(plan.formats(sid))
        wanted[sid] = (recipe or HIGH_PRECISION).key
        reasons[sid] = "" if recipe else why_not(plan.formats(sid))
        layer, site = parse_site_id(sid)
        paths[sid] = module_path(layer % chunk if chunk else layer, site)
    sharing = defaultdict(list)
    for sid in sids:
        sharing[paths[sid]].append(sid)
    sites = []
    for sid in sids:
        config, reason = _shared_config(sid, sharing[paths[sid]], wanted)
        sites.append(SiteExport(sid, plan.formats(sid), paths[sid], config,
                                reasons[sid] or reason))
    return RecipeExport(plan, chunk, tuple(sites))


def _shared_config(sid: str, sharing: list[str], wanted: dict[str, str]) -> tuple[str, str]:
    """The config of the module path ``sid`` shares with the sites ``sharing`` (itself
    included): the one they all want, else BF16; and why ``sid`` does not get its own."""
    keys = {wanted[other] for other in sharing}
    config = keys.pop() if len(keys) == 1 else HIGH_PRECISION.key
    if config == wanted[sid]:
        return config, ""
    others = ", ".join(o for o in sharing if wanted[o] != wanted[sid])
    return config, (f"planned unlike {others}, which has the same module path in another "
                    "pipeline chunk (megatron matches recipes by path)")


def _describe(formats: SiteFormats) -> str:
    text = f"x {formats.x}, w {formats.w}, dy {formats.dy}"
    return text + "".join(f", {op} {fmt}" for op, fmt in formats.overrides)


def _sites(count: int) -> str:
    return f"{count} site{'' if count == 1 else 's'}"


def report(export: RecipeExport) -> list[str]:
    """The export in words: recipes used, sites not expressible and why, TE settings."""
    plan, chunk = export.plan, export.layers_per_chunk
    lines = [f"megatron-core per-module TE recipe of PrecisionPlan '{plan.method}' "
             f"(step {plan.step}, hash {plan.hash[:12]}), {_sites(len(export.sites))}"]
    lines.append("module paths decoder.layers.<i>: i = " + (
        f"layer within a model chunk of {chunk} layers (pipeline split)" if chunk
        else "global layer (no pipeline split)"))
    counts = defaultdict(int)
    for s in export.sites:
        counts[s.config] += 1
    for key, n in counts.items():
        recipe = _BY_KEY[key]
        runs = f"TE {recipe.te_recipe}, GPUs {recipe.gpus}" if recipe.formats else recipe.te_recipe
        lines.append(f"  {key}: {_sites(n)} -> {runs}")
    missing = export.unexpressed()
    lines.append(f"not expressible, run in BF16 by this recipe: {_sites(len(missing))}")
    lines += [f"  {s.site} ({_describe(s.formats)}): {s.reason}" for s in missing]
    for key in counts:
        recipe = _BY_KEY[key]
        if recipe.env:
            lines.append(f"{key}: {recipe.differs}; for ours set {' '.join(recipe.env)}")
    return lines


def write_recipe(export: RecipeExport, path: str) -> None:
    """Write :meth:`RecipeExport.to_yaml` to ``path`` atomically (never a part of a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text_atomic(path, export.to_yaml())
