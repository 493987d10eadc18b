"""The Triton kernels compile for an H100 (sm_90) on this GPU-less machine — what the
interpreter cases cannot show — and keep every value in registers: ``triton.compile`` to a
cubin with the wheel's ptxas, then ``cuobjdump --dump-resource-usage`` (no stack and no local
memory, i.e. no spills). One configuration per launch plan, with the constexprs the launchers
pass: ``benchmarks/triton_sm90.py``'s cases, which that script prints with their SASS length."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.triton_sm90 import BIN, CASES, compile_sm90  # noqa: E402


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "cuobjdump")),
                    reason="this triton wheel ships no CUDA tools")
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90_without_spills(case):
    usage = compile_sm90(*CASES[case]())
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0 and 0 < usage["REG"] <= 255, usage
