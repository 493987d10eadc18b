"""The Triton kernels, run on CPU by the Triton interpreter, against the torch reference.

``TRITON_INTERPRET`` only takes effect if it is set before triton is first imported, and
other tests in this process may import triton compiled; so the cases
(``triton_interpreter_cases.py``) run in a fresh pytest process with the variable set.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import triton  # noqa: F401  (the kernels need it; CI installs triton==3.9.0)

CASES = Path(__file__).with_name("triton_interpreter_cases.py")
REPO = Path(__file__).resolve().parents[3]


def test_triton_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{summary}\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 30 and "failed" not in summary, summary
