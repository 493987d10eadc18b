"""The shell commands of the README and docs/*.md code blocks, as a user would copy them.

Imported by name (``tests/`` is on ``sys.path``) by the tests that keep the documented
commands runnable as written."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from pretrain_runner import REPO


@dataclass(frozen=True)
class DocCommand:
    """One logical command line of a ``bash`` code block (``\\`` continuations joined)."""

    text: str
    """The command, without its trailing ``# comment``."""
    comment: str
    """The trailing comment ('' if none)."""
    where: str
    """``file:line`` of its first line."""

    @property
    def argv(self) -> list[str]:
        """The command split as the shell would (no variables expanded)."""
        return shlex.split(self.text)


def _logical_lines(block: list[tuple[int, str]]):
    """(first line number, joined text) of each command, continuations joined."""
    start, parts = None, []
    for number, line in block:
        if start is None:
            start = number
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1].strip())
            continue
        parts.append(line.strip())
        yield start, " ".join(p for p in parts if p)
        start, parts = None, []


def doc_commands(relative: str) -> list[DocCommand]:
    """Every command of the ``bash`` blocks of ``relative`` (a path under the repository)."""
    lines = (REPO / relative).read_text(encoding="utf-8").splitlines()
    commands, block = [], None
    for number, line in enumerate(lines, start=1):
        if block is None:
            block = [] if line.strip() == "```bash" else None
            continue
        if line.strip() == "```":
            for start, text in _logical_lines(block):
                if text and not text.startswith("#"):
                    code, _, comment = text.partition("  #")
                    commands.append(DocCommand(code.strip(), comment.strip(),
                                               f"{relative}:{start}"))
            block = None
        else:
            block.append((number, line))
    return commands


def find_command(relative: str, pattern: str) -> DocCommand:
    """The one command of ``relative`` whose text or comment matches the regex ``pattern``."""
    found = [c for c in doc_commands(relative) if re.search(pattern, f"{c.text}  # {c.comment}")]
    assert len(found) == 1, f"{relative}: {len(found)} commands match {pattern!r}"
    return found[0]


def flag_values(argv: list[str]) -> dict[str, tuple[str, ...]]:
    """``--flag`` -> the values after it (an empty tuple for a switch)."""
    flags, current = {}, None
    for token in argv:
        if token.startswith("--"):
            current = token
            flags[current] = ()
        elif current is not None:
            flags[current] += (token,)
    return flags
