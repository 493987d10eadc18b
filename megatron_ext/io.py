"""Project-wide file helpers: JSON read with one-line errors, atomic writes.

An atomic write goes to a temporary file in the target's folder, is flushed to disk and then
``os.replace``d over the target: a reader sees the old file or the new one, never half of one,
and a failed write leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable, IO


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
        raise ValueError(f"'{path}' is not valid JSON: {exc.msg} at line {exc.lineno}") \
            from None
    if expect is not None and not isinstance(data, expect):
        what = "an object" if expect is dict else f"a JSON {expect.__name__}"
        raise ValueError(f"'{path}': expected {what}")
    return data


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
