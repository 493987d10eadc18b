"""Project-wide file helpers: JSON / JSONL reads with one-line errors, atomic writes.

An atomic write goes to a temporary file in the target's folder, is flushed to disk and then
``os.replace``d over the target: a reader sees the old file or the new one, never half of one,
and a failed write leaves nothing behind. Outputs are checked before any work starts
(:func:`check_output`), so a typo in an output path costs one line, not a finished run.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, IO

from megatron_ext.errors import UsageError


def read_json(path: str, expect: type | None = dict) -> Any:
    """The parsed JSON of ``path``; a one-line ``ValueError`` if it is missing, unreadable,
    malformed or (with ``expect``) not of that type."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read '{path}': {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"'{path}' is not a JSON text file (not UTF-8)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"'{path}' is not valid JSON: {exc.msg} at line "
                         f"{exc.lineno}") from None
    if expect is not None and not isinstance(data, expect):
        what = "an object" if expect is dict else f"a JSON {expect.__name__}"
        raise ValueError(f"'{path}': expected {what}")
    return data


def read_jsonl(path: str) -> list[dict]:
    """The JSON objects of a JSONL file (one per line, blank lines skipped); an unterminated
    last line that does not parse (a partial write in progress) is skipped; anything else
    malformed is a one-line ``ValueError``."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as exc:
        raise ValueError(f"cannot read '{path}': {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"'{path}' is not a JSONL text file (not UTF-8)") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: a partial last write
                continue
            raise ValueError(f"'{path}' line {number} is not valid JSON") from None
        if not isinstance(record, dict):
            raise ValueError(f"'{path}' line {number} is not a JSON object")
        records.append(record)
    return records


def write_atomic(path: str, write: Callable[[IO], None], binary: bool = False) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, then move it over ``path``
    (readable by all, like a normally created file). The folder must exist."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    write_atomic(path, lambda f: f.write(text))


def write_json_atomic(path: str, data: Any, indent: int | None = 1) -> None:
    """Dump ``data`` as JSON (no NaN / inf) to ``path`` atomically."""
    write_text_atomic(path, json.dumps(data, indent=indent, allow_nan=False) + "\n")


def why_not_a_file(path: str) -> str:
    """Why ``path`` cannot be read as a file: ``is a folder, not a file`` or ``not found``."""
    return "is a folder, not a file" if os.path.isdir(path) else "not found"


# ---------------------------------------------------------------- outputs checked before work

def _nearest_existing(path: str) -> str:
    """``path`` itself or its closest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def check_output(path: str, flag: str, kind: str = "dir") -> None:
    """Before any work starts: ``path`` can be written. A folder (``kind="dir"``) may lack
    folders on its way (the writer creates them); a file (``kind="file"``) needs its folder to
    exist. Creates nothing (the writability probe is a temporary file, removed at once);
    ``UsageError`` naming ``flag`` otherwise: a file where a folder must be, or the reverse, a
    missing folder, no permission."""
    target = os.path.abspath(path)
    if kind == "file":
        if os.path.isdir(target):
            raise UsageError(f"{flag}: '{path}' is a folder, not a file")
        target = os.path.dirname(target)
    existing = _nearest_existing(target)
    if not os.path.isdir(existing):
        raise UsageError(f"{flag}: cannot write '{path}': '{existing}' is a file, not a folder")
    if kind == "file" and existing != target:
        raise UsageError(f"{flag}: cannot write '{path}': folder '{target}' does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=existing)
    except OSError as exc:
        raise UsageError(f"{flag}: cannot write '{path}': cannot create files in "
                         f"'{existing}' ({exc.strerror})") from None
    os.close(fd)
    os.unlink(probe)


@contextmanager
def made_dirs(folder: str):
    """``os.makedirs(folder)``; if the block raises, the folders this call created are removed
    again (each only if still empty), so a failed run leaves no empty output folder."""
    created = []
    path = os.path.abspath(folder)
    while not os.path.lexists(path):
        created.append(path)
        path = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    try:
        yield
    except BaseException:
        for path in created:  # deepest first
            try:
                os.rmdir(path)
            except OSError:
                break
        raise
