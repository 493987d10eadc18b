"""The GaussWS Triton kernels against the torch path, bit for bit, on CPU under the Triton
interpreter. ``TRITON_INTERPRET`` only takes effect if set before triton is first imported
(other tests in this process may import it compiled), so the cases
(``gaussws_triton_cases.py``) run in a fresh pytest process with the variable set."""

import os
import re
import subprocess
import sys
from pathlib import Path

import triton  # noqa: F401  (the kernels need it)

CASES = Path(__file__).with_name("gaussws_triton_cases.py")
REPO = Path(__file__).resolve().parents[4]


def test_gaussws_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{summary}\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 19 and "failed" not in summary, summary
