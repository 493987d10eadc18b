"""Shared fixtures; the launch helpers live in ``pretrain_runner`` (importable by name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain_runner import FAST_ARGS, launch


@pytest.fixture
def run_pretrain(tmp_path):
    """Callable: run_pretrain(name, extra_args, nproc=1) -> run dir (metrics inside)."""

    def _run(name: str, extra: list[str], nproc: int = 1, family: str = "llama") -> Path:
        run_dir = tmp_path / name
        launch([*FAST_ARGS, "--run-dir", str(run_dir), *extra], nproc=nproc, family=family)
        return run_dir

    return _run
