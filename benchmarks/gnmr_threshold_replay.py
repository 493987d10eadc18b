"""GNMR's Table 4 replayed at any thresholds from a run's trace (not a test).

    python benchmarks/gnmr_threshold_replay.py runs/gnmr_trace/seed_*/gnmr/trace.jsonl \
        --pairs 2.0:0.5 3.0:1.0 1.1:0.5 --json out.json

Table 4 of the GNMR paper gives the share of linear blocks whose GNMR exceeds α and whose
Δ-GNMR exceeds β, at (α, β) = (2.0, 0.5) and (3.0, 1.0) (60M: 0.070 % / 0.081 % and
0.019 % / 0.033 %). Algorithm 1's values do not depend on the thresholds, so one run's
``gnmr/trace.jsonl`` (``--gnmr`` writes every unit's ``gnmr`` and ``dgnmr`` each step) answers
every pair; a run with ``--gnmr --gnmr-max-promoted 0`` traces without promoting anything, so
its norms are the fixed low precision's. Counted per unit-step over the trace's steps (the
last line of each step, as a resumed trace repeats some): GNMR > α (a ratio, the paper's
eq. 5) and Δ-GNMR − 1 > β (``--beta-compare excess``, the reading under which β 0.5 is
reachable; ``ratio``: Δ-GNMR > β). Per trace file and pooled; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_trace(path: Path) -> list[dict]:
    """The units' values per step: the last line of each step, in step order."""
    steps = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        steps[record["step"]] = record["units"]
    return [steps[s] for s in sorted(steps)]


def exceedance(steps: list[dict], alpha: float, beta: float, excess: bool) -> dict:
    """Unit-steps with GNMR > alpha and with Δ-GNMR (minus 1 if ``excess``) > beta."""
    over_a = over_b = total = 0
    for units in steps:
        for u in units.values():
            total += 1
            over_a += u["gnmr"] is None or u["gnmr"] > alpha
            d = u["dgnmr"]
            over_b += d is None or (d - 1.0 if excess else d) > beta
    return {"alpha": alpha, "beta": beta, "unit_steps": total, "over_alpha": over_a,
            "over_beta": over_b, "gnmr_pct": 100.0 * over_a / total,
            "dgnmr_pct": 100.0 * over_b / total}


def _pair(text: str) -> tuple[float, float]:
    try:
        a, b = text.split(":")
        return float(a), float(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ALPHA:BETA, got {text!r}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", type=Path, help="gnmr/trace.jsonl files (one per seed)")
    p.add_argument("--pairs", nargs="+", type=_pair, default=[(2.0, 0.5), (3.0, 1.0)],
                   metavar="ALPHA:BETA", help="threshold pairs (default Table 4's 2.0:0.5 3.0:1.0)")
    p.add_argument("--beta-compare", choices=("excess", "ratio"), default="excess",
                   help="Δ-GNMR - 1 > β (default) or Δ-GNMR > β")
    p.add_argument("--json", type=Path, help="write the counts here")
    opts = p.parse_args(argv)
    traces = {str(t): read_trace(t) for t in opts.traces}
    excess = opts.beta_compare == "excess"
    out = []
    for alpha, beta in opts.pairs:
        per = {name: exceedance(steps, alpha, beta, excess) for name, steps in traces.items()}
        pooled = exceedance([u for s in traces.values() for u in s], alpha, beta, excess)
        out.append({"per_trace": per, "pooled": pooled})
        print(f"alpha {alpha} beta {beta} ({opts.beta_compare}): GNMR "
              f"{pooled['gnmr_pct']:.3f} %, Δ-GNMR {pooled['dgnmr_pct']:.3f} % of "
              f"{pooled['unit_steps']} unit-steps; per trace " + ", ".join(
                  f"{v['gnmr_pct']:.3f} / {v['dgnmr_pct']:.3f} %" for v in per.values()))
    if opts.json:
        opts.json.write_text(json.dumps({"beta_compare": opts.beta_compare, "pairs": out},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
