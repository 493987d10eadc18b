"""STQuant's fused Triton step, run on CPU by the Triton interpreter, against the torch path
(the cases are in ``stquant_triton_cases.py``, run in a fresh process: see
``tests/interpreter_runner.py``)."""

from pathlib import Path

import pytest
import triton  # noqa: F401  (the kernel needs it)
from interpreter_runner import assert_cases_pass, interpreter_fma_rounds_once


@pytest.mark.skipif(not interpreter_fma_rounds_once(), reason=(
    "this Triton's interpreter rounds tl.fma twice (triton 3.6), the GPU once: bit for bit "
    "holds on the GPU only (benchmarks/gpu_check.py --sections stquant)"))
def test_fused_step_under_the_interpreter():
    assert_cases_pass(Path(__file__).with_name("stquant_triton_cases.py"), at_least=30)
