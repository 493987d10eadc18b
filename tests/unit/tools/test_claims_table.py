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
    for folder in sorted(d for d in claims_table.CLAIMS.iterdir() if d.is_dir()):
        row = json.loads((folder / "row.json").read_text())
        assert row["provenance"], folder.name
        for spec in row["tests"].values():
            assert (folder / spec["file"]).is_file(), (folder.name, spec["file"])
        _, line = claims_table.render_row(folder)
        verdict_cell = line.rsplit(" | ", 1)[1]
        # a verdict word comes from the rule: either a test's verdict or n/a, and the row's own
        # text outside the {name.verdict} fields says none of the rule's words
        from_rule = row["tests"] and "verdict}" in row["verdict"]
        assert from_rule or verdict_cell.startswith("n/a"), folder.name
        own = claims_table.FIELD.sub("", row["verdict"])
        assert not any(w in own for w in ("reproduced", "refuted", "not separable")), folder.name


def test_a_row_with_random_draws(tmp_path):
    (tmp_path / "seeds.csv").write_text("seed,recipe,r.d0,r.d1\n1,3.0,4.0,5.0\n2,3.0,2.0,6.0\n")
    (tmp_path / "row.json").write_text(json.dumps({
        "order": 1, "claim": "c", "regime": "r", "result": "{x}", "verdict": "{x.verdict}",
        "tests": {"x": {"file": "seeds.csv", "reference": "recipe", "draws": ["r.d0", "r.d1"],
                        "expected": "+"}}, "provenance": {"seeds.csv": "made up"}}))
    # mean of the draws - recipe: 1.5, 1.0 -> mean 1.25, se 0.25, t 5 with 1 df:
    # p = 1 - 2 atan(5)/pi = 0.126, 95 % CI 1.25 ± 12.7062 * 0.25 = 1.25 ± 3.1766;
    # places 0 and 1 of 2 draws: P(U1 + U2 <= 1), U uniform on {0, 1, 2}, = 3/9
    _, line = claims_table.render_row(tmp_path)
    assert line == ("| c | r | +1.2500 ± 0.2500 (t +5.00, 1 df, p 0.126; 2+ 0−); the reference's "
                    "place among the 2 draws per seed 0 / 1 (0: better than every draw), "
                    "permutation p 0.333 | not separable at 2 seeds (95 % CI -1.9266 to "
                    "+4.4266) |")


def test_a_row_against_a_claimed_number(tmp_path):
    (tmp_path / "seeds.csv").write_text("seed,bytes\n1,1.0\n2,2.0\n")
    (tmp_path / "row.json").write_text(json.dumps({
        "order": 1, "claim": "c", "regime": "r", "result": "{x}", "verdict": "{x.verdict}",
        "tests": {"x": {"file": "seeds.csv", "run": "bytes", "reference_value": 8,
                        "expected": "-", "digits": 1}}, "provenance": {"seeds.csv": "made up"}}))
    # 1 - 8, 2 - 8: mean -6.5, se 0.5, t -13 with 1 df
    _, line = claims_table.render_row(tmp_path)
    assert line.startswith("| c | r | -6.5 ± 0.5 (t -13.00, 1 df, p 0.049; 0+ 2−) | "
                           "not separable at 2 seeds")
