"""Paired differences of every run against one chosen run of a comparison grid (not a test).

    python benchmarks/paired_vs_run.py runs/snip_regime/results.json snip

``tools/compare_precision.py`` pairs every run with the grid's reference (FP32). This pairs
them with a method instead, within each group (``group_by``, e.g. ``--snip-budget``): for
every group the run named ``<prefix>-<group>`` against every other run of that group,
``mean ± standard error (t, df, p; signs)`` and the verdict over the seeds both have
(``megatron_ext.compare.stats``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ext.compare.stats import DIRECTION_WORDS, describe, paired, verdict  # noqa: E402


def losses(run: dict) -> dict[int, float]:
    return {int(seed): r["val_loss"] for seed, r in run["seeds"].items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a grid's results.json")
    p.add_argument("prefix", help="the method whose runs are named <prefix>-<group>")
    opts = p.parse_args(argv)
    runs = json.loads(Path(opts.results).read_text())["runs"]
    groups = sorted({r["group"] for r in runs.values() if r.get("group") is not None}, key=str)
    for group in groups:
        name = f"{opts.prefix}-{group}"
        if name not in runs:
            print(f"error: no run '{name}' in {opts.results}", file=sys.stderr)
            return 2
        print(f"group {group}: {name} - run (loss units)")
        for other, run in runs.items():
            if run.get("group") == group and other != name:
                d = paired(losses(runs[name]), losses(run))
                print(f"  {other:24} {describe(d)}: {verdict(d, -1, DIRECTION_WORDS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
