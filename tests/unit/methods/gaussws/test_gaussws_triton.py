"""The GaussWS Triton kernels against the torch path, bit for bit, on CPU under the Triton
interpreter (the cases are in ``gaussws_triton_cases.py``, run in a fresh process: see
``tests/interpreter_runner.py``)."""

from pathlib import Path

import triton  # noqa: F401  (the kernels need it)
from interpreter_runner import assert_cases_pass


def test_gaussws_kernels_under_the_interpreter():
    assert_cases_pass(Path(__file__).with_name("gaussws_triton_cases.py"), at_least=36)
