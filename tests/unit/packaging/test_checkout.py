"""PYTHONPATH naming another checkout than the one a script imports gets one stderr line
(megatron_ext/checkout.py): the trap of a before/after measurement that ran the new code
twice."""

import os
import subprocess
import sys
from pathlib import Path

from megatron_ext.checkout import other_checkouts

REPO = Path(__file__).resolve().parents[3]


def _checkout(root: Path) -> Path:
    (root / "megatron_ext").mkdir(parents=True)
    (root / "megatron_ext" / "__init__.py").write_text("")
    return root


def test_other_checkouts_are_the_entries_with_another_package(tmp_path):
    old = _checkout(tmp_path / "before")
    (tmp_path / "empty").mkdir()
    path = os.pathsep.join([str(old), str(tmp_path / "empty"), str(REPO), ""])
    assert other_checkouts(REPO / "megatron_ext", path) == [str(old)]
    assert other_checkouts(REPO / "megatron_ext", str(REPO)) == []


def _import(pythonpath: str, rank: str = "0") -> str:
    env = {**os.environ, "PYTHONPATH": pythonpath, "RANK": rank}
    proc = subprocess.run([sys.executable, "-c", "import megatron_ext"], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True)
    return proc.stderr


def test_a_script_run_with_another_checkout_on_pythonpath_says_which_runs(tmp_path):
    old = _checkout(tmp_path / "before")
    said = _import(str(old))
    assert (f"note: megatron_ext runs from {REPO}, not from the checkout PYTHONPATH names "
            f"({old})" in said)
    assert "note:" not in _import(str(old), rank="1")  # once per job, not per rank
    assert "note:" not in _import(str(REPO))
