"""The Triton kernels, run on CPU by the Triton interpreter, against the torch reference (the
cases are in ``triton_interpreter_cases.py``, run in a fresh process: see
``tests/interpreter_runner.py``)."""

from pathlib import Path

import triton  # noqa: F401  (the kernels need it; CI installs triton==3.9.0)
from interpreter_runner import assert_cases_pass


def test_triton_kernels_under_the_interpreter():
    assert_cases_pass(Path(__file__).with_name("triton_interpreter_cases.py"), at_least=50)
