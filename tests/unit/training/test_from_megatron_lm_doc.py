"""docs/from_megatron_lm.md names every flag of ``python pretrain_llama.py --help``."""

import re
import runpy
import sys

import pytest

from pretrain_runner import REPO


def _help_text(monkeypatch, capsys) -> str:
    """``python pretrain_llama.py --help``, run in this process."""
    monkeypatch.setattr(sys, "argv", ["pretrain_llama.py", "--help"])
    monkeypatch.setenv("COLUMNS", "10000")  # argparse would wrap long flags at their hyphens
    with pytest.raises(SystemExit):
        runpy.run_path(str(REPO / "pretrain_llama.py"), run_name="__main__")
    return capsys.readouterr().out


def test_every_flag_is_on_the_page(monkeypatch, capsys):
    flags = set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9_-]*", _help_text(monkeypatch, capsys)))
    flags = {f for f in flags if f != "--help" and not f.startswith("--no-")}
    assert "--dry-run" in flags and "--tensor-model-parallel-size" in flags
    page = (REPO / "docs" / "from_megatron_lm.md").read_text()
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", page))
    assert not missing, f"add these flags to docs/from_megatron_lm.md: {missing}"
