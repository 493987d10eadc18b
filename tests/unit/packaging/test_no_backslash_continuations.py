"""No backslash line continuations in the repository's Python (the project's style: brackets
instead); a backslash ending a line inside a string (a shell example in a docstring) is text."""

import io
import subprocess
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def continued_lines(text: str) -> list[int]:
    """Lines that end in a backslash continuation (outside strings)."""
    in_string = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.STRING:
            in_string.update(range(token.start[0], token.end[0]))
    return [n for n, line in enumerate(text.splitlines(), 1)
            if line.endswith("\\") and n not in in_string]


def test_the_checker_finds_a_continuation_and_skips_strings():
    code = 'x = 1 + \\\n    2\ndoc = """run \\\n  --flag"""\n'
    assert continued_lines(code) == [1]


def test_no_python_file_continues_a_line_with_a_backslash():
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    found = {f: lines for f in files
             if (lines := continued_lines((REPO / f).read_text(encoding="utf-8")))}
    assert not found, f"backslash continuations (use brackets): {found}"
