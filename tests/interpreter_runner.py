"""Run a file of Triton-kernel test cases on CPU under the Triton interpreter.

``TRITON_INTERPRET`` only takes effect if it is set before triton is first imported, and other
tests in this process may import triton compiled; so the cases run in a fresh pytest process
with the variable set, and the calling test checks its summary.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def assert_cases_pass(cases: Path, at_least: int) -> None:
    """Run ``cases`` under ``TRITON_INTERPRET=1``; fail unless all pass, ``at_least`` of them."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           "-n", "0", str(cases)]  # in one process: the calling test holds a worker already
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{summary}\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= at_least and "failed" not in summary, summary


def interpreter_fma_rounds_once() -> bool:
    """Whether this Triton's interpreter rounds ``tl.fma`` once, as the GPU does (triton 3.6's
    multiplies, rounds, then adds): ``(1 + 2**-12)**2 - (1 + 2**-11)`` is ``2**-24`` only so."""
    import numpy as np
    import triton.language as tl

    try:
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

        a, c = np.float32(1 + 2**-12), np.float32(-(1 + 2**-11))
        handle = [TensorHandle(np.array([v], np.float32), tl.float32) for v in (a, a, c)]
        return bool(InterpreterBuilder().create_fma(*handle).data[0] == 2**-24)
    except (ImportError, AttributeError, TypeError):  # another Triton's internals: run the
        return True  # cases, which then say whether its fma rounds once
