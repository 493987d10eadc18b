"""The documents a newcomer reads keep their shape: BENCHMARKS.md holds today's figures (short,
no lab-notebook narrative, every table linked to the campaign file that records it), the
README's first screen holds no commit hash, and docs/ and the README carry no session
narrative."""

import re

import pytest

from pretrain_runner import REPO

BENCHMARKS = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
README = (REPO / "README.md").read_text(encoding="utf-8")
CAMPAIGN = re.compile(r"\]\((benchmarks/results/(\d{4}-\d\d-\d\d-[a-z0-9-]+\.md))\)")
NARRATIVE = re.compile(r"next\s+(GPU\s+)?session|was\s+lent|session\s+[0-9]", re.IGNORECASE)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each ``## `` section."""
    parts = re.split(r"^## (.*)$", text, flags=re.MULTILINE)
    return list(zip(parts[1::2], parts[2::2]))


def test_benchmarks_is_short():
    assert BENCHMARKS.count("\n") <= 400


@pytest.mark.parametrize("pattern", [r"\b\d\d:\d\d UTC", r"\bcall \d", r"\brun [A-Z]\b"])
def test_benchmarks_has_no_notebook_narrative(pattern):
    found = [line for line in BENCHMARKS.splitlines() if re.search(pattern, line)]
    assert not found, found


def test_every_table_section_links_an_existing_campaign():
    tables = [(h, body) for h, body in _sections(BENCHMARKS) if re.search(r"^\|", body, re.M)]
    assert len(tables) >= 6
    for heading, body in tables:
        links = CAMPAIGN.findall(body)
        assert links, f"BENCHMARKS.md '{heading}': no benchmarks/results/ campaign linked"
        for path, _ in links:
            assert (REPO / path).is_file(), path


def test_the_claims_table_sits_between_its_markers():
    begin, end = "<!-- claims-table:begin -->", "<!-- claims-table:end -->"
    assert BENCHMARKS.count(begin) == BENCHMARKS.count(end) == 1
    inside = BENCHMARKS[BENCHMARKS.index(begin):BENCHMARKS.index(end)]
    assert re.search(r"^\|.*\|$", inside, re.MULTILINE), "no table between the markers"


def test_the_readme_first_screen_has_no_commit_hash():
    first = "\n".join(README.splitlines()[:40])
    assert not COMMIT.findall(first)
    assert "pytest" in first and "python pretrain_llama.py" in first


def test_the_commit_pattern_finds_a_hash_and_spares_numbers():
    found = COMMIT.findall("at 49fcc4f, 1,787,008 parameters, 4aa4122e and 20260127")
    assert found == ["49fcc4f", "4aa4122e"]


def test_docs_carry_no_session_narrative():
    """The issue's grep, also across a line break."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = [f"{page.relative_to(REPO)}: {' '.join(m.group(0).split())}" for page in pages
             for m in NARRATIVE.finditer(page.read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)
