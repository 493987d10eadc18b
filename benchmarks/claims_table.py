"""The BENCHMARKS.md claim table, regenerated from the kept evidence alone (not a test).

    python benchmarks/claims_table.py            # rewrite the table in BENCHMARKS.md
    python benchmarks/claims_table.py --check    # exit 1 if BENCHMARKS.md's table differs

Every folder ``benchmarks/results/claims/<claim>/`` is one row: ``row.json`` and the per-seed
files it names (CSV: a ``seed`` column and one column per value; JSON: the metrics the row
reads). ``row.json``::

    {"order": 10,                      # the row's place in the table
     "claim": "...", "regime": "...",  # the first two cells, Markdown as printed
     "result": "... {name} ...",       # the third cell: {name} = the test's numbers
     "verdict": "{name.verdict} ...",  # the fourth: {name.verdict} = the rule's words
     "tests": {"name": {"file": "seeds.csv", "run": "col", "reference": "col",
                        "expected": "+" | "-" | "0", "digits": 4}},  # or "diff": "col"
     "provenance": {...}}              # commit, command, where transcribed numbers come from

A test is the paired difference ``run - reference`` (or ``run - reference_value``, a number;
or the column ``diff``; or, with ``"draws": [columns]``, the mean of the draws - reference,
with the reference's place among the draws per seed and its permutation p) over the seeds of
its file, with
``megatron_ext.compare.stats``'s t test (``{name}``: mean ± SE, t, df, p, sign count,
``digits`` decimals, default 4; one seed: n/a) and the verdict rule (``{name.verdict}``:
reproduced / refuted at p < 0.05 with >= 5 seeds in the claimed direction ``expected``, else
not separable at n seeds with the 95 % interval).
The table is written between ``<!-- claims-table:begin -->`` and ``<!-- claims-table:end -->``
and nowhere else.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_ext.compare.stats import (Paired, describe, paired, paired_diffs,  # noqa: E402
                                        place_among_draws, verdict)

CLAIMS = ROOT / "benchmarks" / "results" / "claims"
"""One folder per claim row."""
BEGIN, END = "<!-- claims-table:begin -->", "<!-- claims-table:end -->"
"""The markers around the table in BENCHMARKS.md."""
HEADER = ("| claim | regime here (vs the paper's) | result (paired Δ: mean ± SE, t test, "
          "signs) | verdict (p < 0.05, ≥ 5 seeds) |\n| --- | --- | --- | --- |")
"""The table's first two lines."""
EXPECTED = {"+": 1, "-": -1, "0": 0}
"""``expected`` in row.json as the verdict's sign."""
FIELD = re.compile(r"\{(\w+)(\.verdict)?\}")
"""``{name}`` / ``{name.verdict}`` in a row's result and verdict cells."""


def read_columns(path: Path) -> dict[str, dict[int, float]]:
    """Column -> seed -> value of a per-seed CSV (empty cells skipped)."""
    columns: dict[str, dict[int, float]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            seed = int(row.pop("seed"))
            for name, value in row.items():
                if value not in ("", None):
                    columns.setdefault(name, {})[seed] = float(value)
    return columns


def run_test(folder: Path, spec: dict) -> tuple[Paired, str]:
    """The paired differences a test of ``row.json`` names, and the text after its numbers
    (for draws: the reference's place among them per seed and the permutation p)."""
    columns = read_columns(folder / spec["file"])
    if "diff" in spec:
        return paired_diffs(columns[spec["diff"]]), ""
    if "reference_value" in spec:  # a claimed number, e.g. AdamW's 8 bytes per parameter
        run = columns[spec["run"]]
        return paired(run, {s: spec["reference_value"] for s in run}), ""
    ref = columns[spec["reference"]]
    if "draws" not in spec:
        return paired(columns[spec["run"]], ref), ""
    seeds = [s for s in ref if all(s in columns[d] for d in spec["draws"])]
    per_seed = {s: [columns[d][s] for d in spec["draws"]] for s in seeds}
    place, p = place_among_draws({s: ref[s] for s in seeds}, per_seed)
    diff = paired({s: sum(v) / len(v) for s, v in per_seed.items()}, ref)
    return diff, (f"; the reference's place among the {len(spec['draws'])} draws per seed "
                  f"{' / '.join(str(place[s]) for s in seeds)} (0: better than every draw), "
                  f"permutation p {p:.3f}")


def render_row(folder: Path) -> tuple[float, str]:
    """(order, the row's Markdown line)."""
    row = json.loads((folder / "row.json").read_text())
    tests = {name: (*run_test(folder, spec), EXPECTED[spec["expected"]], spec.get("digits", 4))
             for name, spec in row.get("tests", {}).items()}

    def fill(text: str) -> str:
        def one(match: re.Match) -> str:
            diff, extra, expected, digits = tests[match.group(1)]
            return verdict(diff, expected) if match.group(2) else describe(diff, digits) + extra
        return FIELD.sub(one, text)

    cells = [row["claim"], row["regime"], fill(row["result"]), fill(row["verdict"])]
    return row["order"], "| " + " | ".join(cells) + " |"


def table() -> str:
    """The whole table (header and rows in ``order``), without the markers."""
    rows = sorted(render_row(d) for d in CLAIMS.iterdir() if (d / "row.json").is_file())
    return "\n".join([HEADER, *(line for _, line in rows)])


def replace_table(text: str, new: str) -> str:
    """``text`` with everything between the markers replaced by ``new``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"error: BENCHMARKS.md lacks {BEGIN} ... {END}")
    return text[:start + len(BEGIN)] + "\n" + new + "\n" + text[end:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="compare with BENCHMARKS.md instead of writing it (exit 1 if it differs)")
    p.add_argument("--benchmarks", type=Path, default=ROOT / "BENCHMARKS.md",
                   help="the file with the markers (default: the repository's BENCHMARKS.md)")
    opts = p.parse_args(argv)
    text = opts.benchmarks.read_text()
    new = replace_table(text, table())
    if opts.check:
        if new != text:
            print(f"{opts.benchmarks}: the claim table differs from benchmarks/results/claims/ "
                  "(run benchmarks/claims_table.py)")
            return 1
        print(f"{opts.benchmarks}: the claim table matches benchmarks/results/claims/")
        return 0
    if new != text:
        opts.benchmarks.write_text(new)
    print(f"wrote the claim table of {opts.benchmarks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
