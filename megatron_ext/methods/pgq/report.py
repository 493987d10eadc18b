"""A recipe's explanation (PGQ stage ii's output, "to foster user trust"): one row per GEMM —
min SQNR, its operand, the threshold, intensity, decision, reason — as Markdown and JSON.

Files (:func:`write_recipe`, atomic): ``recipe.md``, ``recipe.json`` and, from the tool,
``plan.json`` (the PrecisionPlan, for ``--precision-plan``). In training they sit in
``<run>/pgq/`` beside ``profile.json``; the plan itself is the run's
``precision_plan.json``.
"""

from __future__ import annotations

import dataclasses
import math
import os

from megatron_ext.io import write_json_atomic, write_text_atomic
from megatron_ext.methods.pgq.recipe import Recipe, sqnr_text
from megatron_ext.precision.plan import save_plan


def _finite(value: float | None) -> float | None:
    """JSON has no infinity: ``inf`` (exact, or nothing quantized) becomes null."""
    return None if value is None or math.isinf(value) else value


def _condition(recipe: Recipe) -> str:
    cfg = recipe.config
    fwd, bwd = (_finite(t * recipe.scale) for t in (cfg.fwd_threshold, cfg.bwd_threshold))
    budget = "" if cfg.budget is None else f", budget {cfg.budget:g}"
    if fwd is None:
        return f"{cfg.format}: nothing quantized{budget}"
    return f"{cfg.format}, SQNR fwd >= {fwd:.3g}, bwd >= {bwd:.3g}{budget}"


def summary(recipe: Recipe) -> str:
    """One line: what was quantized, at what FLOP share and estimated GEMM time."""
    rows = [d for d in recipe.decisions if d.linear]
    roof = "no roofline" if recipe.device is None else f"ridge {recipe.device.ridge:.0f} FLOP/B"
    budget = recipe.config.budget
    short = (budget is not None and recipe.config.mode == "recipe"
             and recipe.fraction < budget - 1e-9)
    reach = f" [budget {budget:g} out of reach: every compute-bound GEMM]" if short else ""
    fwd = sum(d.quantized for d in rows if d.direction == "forward")
    head = [d.name.split(".")[1] for d in recipe.decisions if d.quantized and not d.linear]
    logits = f", logits {'+'.join(head) or 'none'}" if recipe.config.logits else ""
    return (f"{recipe.plan.method} ({_condition(recipe)}; {roof}){reach}: "
            f"{sum(d.quantized for d in rows)} of {len(rows)} linear GEMMs quantized "
            f"({fwd} fwd / {sum(d.quantized for d in rows) - fwd} bwd; "
            f"{sum(d.eligible for d in rows)} compute-bound){logits}, "
            f"{100 * recipe.fraction:.1f}% of {_flops_of(recipe)} FLOPs, "
            f"est. GEMM time {recipe.time_vs_bf16:.2f}x BF16")


def _flops_of(recipe: Recipe) -> str:
    return "linear + logits" if recipe.config.logits else "linear"


def recipe_json(recipe: Recipe) -> dict:
    """The explanation as a JSON object (``inf`` -> null)."""
    cfg = recipe.config
    device = None if recipe.device is None else {"name": recipe.device.name,
                                                 "ridge": recipe.device.ridge}
    rows = [{**dataclasses.asdict(d), "min_sqnr": _finite(d.min_sqnr),
             "min_sqnr_db": _finite(10 * math.log10(d.min_sqnr)) if d.min_sqnr > 0 else None,
             "threshold": _finite(d.threshold)} for d in recipe.decisions]
    return {"version": 1, "kind": "pgq-recipe", "config": dataclasses.asdict(cfg),
            "device": device, "scale": _finite(recipe.scale),
            "thresholds": {"forward": _finite(cfg.fwd_threshold * recipe.scale),
                           "backward": _finite(cfg.bwd_threshold * recipe.scale)},
            "fraction": recipe.fraction, "target": recipe.target,
            "time_vs_bf16": recipe.time_vs_bf16, "summary": summary(recipe),
            "logits": None if recipe.logits is None else recipe.logits.to_dict(),
            "plan_hash": recipe.plan.hash, "gemms": rows}


def recipe_markdown(recipe: Recipe) -> str:
    """The explanation table (every GEMM) under a short header."""
    cfg = recipe.config
    device = ("none (every GEMM eligible)" if recipe.device is None else
              f"{recipe.device.name}: ridge {recipe.device.ridge:.0f} FLOP/B")
    target = "" if recipe.target is None else f" (target {100 * recipe.target:.1f}%)"
    lines = [f"# PGQ {recipe.plan.method}", "",
             f"* format `{cfg.format}`; thresholds (SQNR ratio) forward "
             f"{cfg.fwd_threshold:g}, backward {cfg.bwd_threshold:g}, scaled by "
             f"{_finite(recipe.scale) or 'inf'}",
             f"* roofline: {device}",
             f"* quantized: {100 * recipe.fraction:.1f}% of {_flops_of(recipe)} FLOPs{target}; "
             "est. linear "
             f"GEMM time {recipe.time_vs_bf16:.2f}x BF16", f"* {summary(recipe)}", "",
             "| GEMM | dir | min SQNR | operand | threshold | intensity | decision | reason |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for d in recipe.decisions:
        decision = "**quantized**" if d.quantized else "kept"
        lines.append(f"| {d.name} | {d.direction[:3]} | {sqnr_text(d.min_sqnr)} | {d.worst} | "
                     f"{d.threshold:.3g} | {d.intensity:.0f} | {decision} | {d.reason} |")
    return "\n".join(lines) + "\n"


def write_recipe(recipe: Recipe, out_dir: str, with_plan: bool = False) -> list[str]:
    """Write ``recipe.md``, ``recipe.json`` (and ``plan.json``) into ``out_dir``; their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in ("recipe.md", "recipe.json", "plan.json")]
    write_text_atomic(paths[0], recipe_markdown(recipe))
    write_json_atomic(paths[1], recipe_json(recipe))
    if with_plan:
        save_plan(recipe.plan, paths[2])
    return paths if with_plan else paths[:2]
