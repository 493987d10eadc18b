"""STQuant's fused Triton step, run on CPU by the Triton interpreter, against the torch path
(the cases are in ``stquant_triton_cases.py``; ``TRITON_INTERPRET`` must be set before triton
is first imported, hence a fresh process)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import triton  # noqa: F401  (the kernel needs it)

CASES = Path(__file__).with_name("stquant_triton_cases.py")
REPO = Path(__file__).resolve().parents[4]


def test_fused_step_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           str(CASES)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{summary}\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 30 and "failed" not in summary, summary
