"""benchmarks/claims_table.py: BENCHMARKS.md's claim table is exactly what the kept evidence
in benchmarks/results/claims/ regenerates (issue 39), and the script touches nothing outside
the markers."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "claims_table.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import claims_table  # noqa: E402


def test_benchmarks_md_table_is_regenerated_byte_for_byte():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_only_the_text_between_the_markers_is_rewritten(tmp_path):
    text = (ROOT / "BENCHMARKS.md").read_text()
    begin, end = text.index(claims_table.BEGIN), text.index(claims_table.END)
    stale = text[:begin] + claims_table.BEGIN + "\n| old | table |\n" + text[end:]
    path = tmp_path / "B.md"
    path.write_text(stale)
    assert claims_table.main(["--check", "--benchmarks", str(path)]) == 1
    assert claims_table.main(["--benchmarks", str(path)]) == 0
    assert path.read_text() == text


def test_every_row_has_evidence_files_and_a_verdict_by_the_rule():
    for folder in sorted(claims_table.CLAIMS.iterdir()):
        row = json.loads((folder / "row.json").read_text())
        assert row["provenance"], folder.name
        for spec in row["tests"].values():
            assert (folder / spec["file"]).is_file(), (folder.name, spec["file"])
        _, line = claims_table.render_row(folder)
        verdict_cell = line.rsplit(" | ", 1)[1]
        # a verdict word comes from the rule: either a test's verdict or n/a, and the row's own
        # text outside the {name.verdict} fields says none of the rule's words
        assert row["tests"] and "verdict}" in row["verdict"] or verdict_cell.startswith("n/a"), \
            folder.name
        own = claims_table.FIELD.sub("", row["verdict"])
        assert not any(w in own for w in ("reproduced", "refuted", "not separable")), folder.name
