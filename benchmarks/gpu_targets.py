"""Issue 22's GPU targets against a ``gpu_check`` run's results (not a test).

    python benchmarks/gpu_targets.py /tmp/gc/gpu_check.json /tmp/gc2/gpu_check.json

Reads one or more ``gpu_check.json`` files (docs/gpu.md's two calls write two; a section or
training row of a later file replaces the earlier one's) and prints one row per target:
what was measured, the target, and ``met`` / ``NOT met`` / ``not run``. ``gpu_check``
writes the same table at the top of its ``gpu_check.md``. The numbers are the check's own;
nothing here measures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def merged(results: list[dict]) -> dict:
    """The sections of ``results`` in order, training rows merged by their ``config``."""
    out: dict = {}
    for result in results:
        for name, section in result.items():
            if name == "train" and "rows" in out.get("train", {}) and "rows" in section:
                rows = {r["config"]: r for r in out["train"]["rows"]}
                rows.update({r["config"]: r for r in section["rows"]})
                out["train"] = {**section, "rows": list(rows.values())}
            else:
                out[name] = section
    return out


def _row(results: dict, config: str) -> dict | None:
    rows = results.get("train", {}).get("rows", [])
    row = next((r for r in rows if r.get("config") == config), None)
    return row if row is not None and "error" not in row else None


def _step_ratio(results: dict, config: str, base: str) -> float | None:
    """``config``'s median step time over ``base``'s (from their tokens/s: same tokens a
    step), None when either row is missing."""
    a, b = _row(results, config), _row(results, base)
    if a is None or b is None or "tokens/s" not in a or "tokens/s" not in b:
        return None
    return round(b["tokens/s"] / a["tokens/s"], 2)


def _target(name: str, value, limit: float, how: str = "") -> dict:
    """One row; ``value`` None: not run; a string: the check's error for it."""
    if value is None or isinstance(value, str):
        verdict, measured = ("not run", "") if value is None else ("error", value[:120])
    else:
        verdict, measured = ("met" if value <= limit else "NOT met"), f"{value}{how}"
    return {"target": name, "measured": measured, "limit": f"<= {limit}", "verdict": verdict}


def _formats(results: dict) -> dict:
    """Every format <= 3x ``clone()`` (both dtypes), naming the ones over it."""
    rows = [r for r in results.get("formats", {}).get("rows", []) if "x_clone" in r]
    if not rows:
        return _target("every format's GPU path x clone()", None, 3.0)
    worst = max(rows, key=lambda r: r["x_clone"])
    over = [f"{r['format']} {r['dtype']} {r['x_clone']}x" for r in rows if r["x_clone"] > 3.0]
    row = _target("every format's GPU path x clone()", worst["x_clone"], 3.0,
                  f"x (worst: {worst['format']} {worst['dtype']})")
    if over:
        row["measured"] += "; over: " + ", ".join(over)
    return row


def _stquant(results: dict) -> dict:
    """STQuant's optimizer step over torch's fused AdamW, the worst of its bit widths."""
    rows = [r for r in results.get("stquant", {}).get("rows", [])
            if str(r.get("operation", "")).startswith("optimizer step stquant")
            and r.get("x_adamw_fused") is not None]
    worst = max((r["x_adamw_fused"] for r in rows), default=None)
    return _target("STQuant optimizer step x fused AdamW", worst, 1.5, "x")


def targets(results: dict) -> list[dict]:
    """Issue 22's GPU targets, one row each (module docstring)."""
    snip, pgq = _row(results, "snip"), _row(results, "pgq")
    profile = pgq.get("profile batch x step") if pgq else None
    warm = pgq.get("last profile batch x step") if pgq else None
    return [
        _target("SNIP refresh peak memory x a normal step's", snip and
                snip.get("refresh x step memory"), 1.15, "x"),
        _target("SNIP step time x BF16's", _step_ratio(results, "snip", "bf16"), 1.15, "x"),
        _target("SNIP step time x its own plan's (--precision-plan)",
                _step_ratio(results, "snip", "snip plan"), 1.15, "x"),
        _target("PGQ step time x its recipe's (--precision-plan)",
                _step_ratio(results, "pgq", "pgq plan"), 1.05, "x"),
        _target("PGQ profile per batch x a step", profile, 2.0, "x"),
        _target("PGQ profile's last batch x a step (no first-use Triton compilation)", warm,
                2.0, "x"),
        _stquant(results),
        _formats(results),
    ]


def markdown(results: dict) -> list[str]:
    """The target rows as a markdown table (lines)."""
    rows = targets(results)
    keys = list(rows[0])
    return (["### issue 22 targets", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows] + [""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="gpu_check.json files, in run order")
    args = p.parse_args(argv)
    try:
        results = [json.loads(path.read_text()) for path in args.results]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(markdown(merged(results))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
