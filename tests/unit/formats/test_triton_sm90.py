"""The Triton kernels compile for an H100 (sm_90) on this GPU-less machine — what the
interpreter cases cannot show — and keep every value in registers: ``triton.compile`` to a
cubin with the wheel's ptxas, then ``cuobjdump --dump-resource-usage`` (no stack and no local
memory, i.e. no spills). One configuration per launch plan, with the constexprs the launchers pass."""

import os
import re
import subprocess
import tempfile

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_ext.formats import get_format, triton_error, triton_kernels as tk

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
BF16 = torch.zeros(1, dtype=torch.bfloat16)


def _element(name: str) -> dict:
    args = tk._element_args(get_format(name), BF16, torch.Generator().manual_seed(0))
    return {k: v for k, v in args.items() if k not in ("seed", "enable_fp_fusion")}


def _fused(name: str, block_m: int, block_k: int, warps: int):
    pointers = {"x_ptr": "*bf16", "y_ptr": "*bf16", "tensor_amax_ptr": "*fp32"}
    constexprs = dict(BLOCK_M=block_m, NUM_BLOCKS=1, BLOCK_K=block_k, SCALING=tk._AMAX)
    return tk._fused_kernel, pointers, {**constexprs, **_element(name)}, warps


def _apply(name: str):
    pointers = {"x_ptr": "*bf16", "y_ptr": "*bf16", "amax_ptr": "*i32"}
    return tk._apply_kernel, pointers, dict(BLOCK_M=8, BLOCK_K=1024, **_element(name)), 8


CASES = {  # the launchers' sizes: 32 values a thread, 16 with stochastic rounding
    "fused 1x128 tiles": _fused("fp8_e4m3@tile128", 32, 128, 4),
    "fused 1x128 tiles, +sr": _fused("fp4_e2m1@tile128+sr", 32, 128, 8),
    "fused row of 16384": _fused("int8@row", 1, 16384, 16),
    "fused row of 8192, +sr": _fused("int8@row+sr", 1, 8192, 16),
    "two-pass amax": (tk._amax_kernel, {"x_ptr": "*bf16", "amax_ptr": "*i32"},
                      dict(BLOCK_M=8, BLOCK_K=1024, PER_ROW=False), 8),
    "two-pass apply": _apply("fp8_e4m3"),
    "two-pass apply, +sr": _apply("fp4_e2m1+sr"),
    "error sums": (triton_error._error_sums_kernel,
                   {"t_ptr": "*bf16", "q_ptr": "*bf16", "partial_ptr": "*fp64"},
                   dict(BLOCK=triton_error.BLOCK), 8),
}


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "cuobjdump")),
                    reason="this triton wheel ships no CUDA tools")
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90_without_spills(case):
    kernel, pointers, constexprs, warps = CASES[case]
    signature = {name: pointers.get(name, "i32") for name in kernel.arg_names
                 if name not in constexprs}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "enable_fp_fusion": False})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage",
                                cubin.name], capture_output=True, text=True, check=True).stdout
    regs, stack, local = (int(re.search(rf"{key}:(\d+)", usage).group(1))
                          for key in ("REG", "STACK", "LOCAL"))
    assert stack == 0 and local == 0 and 0 < regs <= 255, usage  # spills would use the stack
