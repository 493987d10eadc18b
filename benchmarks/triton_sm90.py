"""Registers, stack and SASS length of the Triton kernels (the formats package's, GaussWS's)
compiled for an H100 (sm_90), on a machine without a GPU (not a test;
``tests/unit/formats/test_triton_sm90.py`` asserts no spills from the same compiles).

    python benchmarks/triton_sm90.py                   # one row per launch plan
    PYTHONPATH=OLD_CHECKOUT python benchmarks/triton_sm90.py   # another commit's kernels

``triton.compile`` to a cubin with the triton wheel's ptxas, then the wheel's ``cuobjdump
--dump-resource-usage`` (REG, STACK: a spill would use the stack) and ``nvdisasm`` (SASS
instructions; integer ones: IMAD, IADD3, LOP3, SHF). One configuration per plan, with the
sizes the launchers pass (BF16 input); a plan the imported package lacks is left out.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
INT_OPS = ("IMAD", "IADD3", "LOP3", "SHF")


def _element(name: str) -> dict:
    from megatron_ext.formats import get_format, triton_kernels as tk

    bf16 = torch.zeros(1, dtype=torch.bfloat16)
    args = tk._element_args(get_format(name), bf16, torch.Generator().manual_seed(0))
    return {k: v for k, v in args.items() if k not in ("seed", "enable_fp_fusion")}


def _fused(name: str, block_m: int, block_k: int, warps: int):
    from megatron_ext.formats import triton_kernels as tk

    pointers = {"x_ptr": "*bf16", "y_ptr": "*bf16", "tensor_amax_ptr": "*fp32"}
    constexprs = dict(BLOCK_M=block_m, NUM_BLOCKS=1, BLOCK_K=block_k, SCALING=tk._AMAX)
    return tk._fused_kernel, pointers, {**constexprs, **_element(name)}, warps


def _apply(name: str):
    from megatron_ext.formats import triton_kernels as tk

    pointers = {"x_ptr": "*bf16", "y_ptr": "*bf16", "amax_ptr": "*i32"}
    return tk._apply_kernel, pointers, dict(BLOCK_M=8, BLOCK_K=1024, **_element(name)), 8


def _amax():
    from megatron_ext.formats import triton_kernels as tk

    return (tk._amax_kernel, {"x_ptr": "*bf16", "amax_ptr": "*i32"},
            dict(BLOCK_M=8, BLOCK_K=1024, PER_ROW=False), 8)


def _error_sums():
    from megatron_ext.formats import triton_error

    return (triton_error._error_sums_kernel,
            {"t_ptr": "*bf16", "q_ptr": "*bf16", "partial_ptr": "*fp64"},
            dict(BLOCK=triton_error.BLOCK), 8)


def _to_fp8(plan: str):
    """The real-FP8 cast (``formats/triton_fp8.py``) of a BF16 operand into E4M3."""
    from megatron_ext.formats import get_format, triton_fp8 as tf

    element = tf.element_args(get_format("fp8_e4m3").element)
    pointers = {"x_ptr": "*bf16", "amax_ptr": "*bf16", "out_ptr": "*fp8e4nv",
                "scale_ptr": "*fp32"}
    if plan.startswith("scale and cast"):
        rows, write_t = "whole rows" in plan, plan.endswith("transposed")
        return (tf._scale_cast_kernel, {**pointers, "out_t_ptr": "*fp8e4nv"},
                dict(BLOCK=tf._BLOCK // (1 if rows else 2), WHOLE_ROWS=rows, WRITE_T=write_t,
                     **element), 16 if rows else 4)
    block_m, block_k = (32, 128) if plan == "tiles" else (1, 8192)
    return (tf._quantize_blocks_kernel, pointers,
            dict(BLOCK_M=block_m, GROUP_M=1, BLOCK_K=block_k, **element), 16 if plan == "row" else 4)


def _gaussws(kernel: str):
    from megatron_ext.methods.gaussws import triton_kernels as gk

    types = {"rows_ptr": "*i64", "scale_ptr": "*fp32", "out_ptr": "*fp32", "key_gamma": "i64"}
    if kernel == "noise_dot":  # BF16 gradients, read as int16
        return (gk._noise_dot_kernel, {**types, "grad_ptr": "*i16"},
                dict(BLOCK=32, BLOCK_P=32, BLOCK_R=32, BF16=True), 4)
    return (gk._perturb_kernel, {**types, "w_ptr": "*i16", "out_ptr": "*i16"},
            dict(BLOCK=32, BLOCK_R=32, BLOCK_C=64, BF16=True), 4)


CASES = {  # the launchers' sizes: 32 values a thread, 16 with stochastic rounding
    "fused 1x128 tiles": lambda: _fused("fp8_e4m3@tile128", 32, 128, 4),
    "fused 1x128 tiles, +sr": lambda: _fused("fp4_e2m1@tile128+sr", 32, 128, 8),
    "fused row of 16384": lambda: _fused("int8@row", 1, 16384, 16),
    "fused row of 8192, +sr": lambda: _fused("int8@row+sr", 1, 8192, 16),
    "two-pass amax": _amax,
    "two-pass apply, fp8_e4m3": lambda: _apply("fp8_e4m3"),
    "two-pass apply, fp4_e2m1": lambda: _apply("fp4_e2m1"),
    "two-pass apply, +sr": lambda: _apply("fp4_e2m1+sr"),
    "error sums": _error_sums,
    "to_fp8 two-pass cast, blocks": lambda: _to_fp8("scale and cast, blocks"),
    "to_fp8 two-pass cast, rows": lambda: _to_fp8("scale and cast, whole rows"),
    "to_fp8 two-pass cast, rows and transposed":
        lambda: _to_fp8("scale and cast, whole rows, transposed"),
    "to_fp8 one pass, 1x128 tiles": lambda: _to_fp8("tiles"),
    "to_fp8 one pass, row of 8192": lambda: _to_fp8("row"),
    "GaussWS perturb, BF16": lambda: _gaussws("perturb"),
    "GaussWS eq. 3 sums, BF16": lambda: _gaussws("noise_dot"),
}
"""Plan -> a builder of (kernel, pointer types, constexprs, warps), as launched (the test
asserts each compiles without spills)."""
AVOIDED = {
    "fused 1x128 tiles, +sr, 4w": lambda: _fused("fp4_e2m1@tile128+sr", 32, 128, 4),
    "fused row of 16384, +sr": lambda: _fused("int8@row+sr", 1, 16384, 16),
}
"""Printed too: what the launchers avoid because it spills — the 4 warps stochastic rounding
had before, and a per-row SR row of 16384 (two passes instead)."""


def compile_sm90(kernel, pointers: dict, constexprs: dict, warps: int) -> dict:
    """REG, STACK, LOCAL (bytes a thread) and SASS instruction counts of one compile."""
    signature = {name: pointers.get(name, "i32") for name in kernel.arg_names
                 if name not in constexprs}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "enable_fp_fusion": False})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = _tool("cuobjdump", "--dump-resource-usage", cubin.name)
        sass = [line for line in _tool("nvdisasm", cubin.name).splitlines()
                if line.strip().startswith("/*") and ";" in line]
    out = {key: int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK", "LOCAL")}
    return {**out, "sass": len(sass), "int ops": sum(any(op in l for op in INT_OPS) for l in sass)}


def _tool(name: str, *args: str) -> str:
    return subprocess.run([os.path.join(BIN, name), *args], capture_output=True, text=True,
                          check=True).stdout


def main() -> None:
    print(f"{'plan':<28}{'warps':>6}{'REG':>6}{'STACK':>7}{'LOCAL':>7}{'SASS':>7}{'int ops':>9}")
    for plan, build in {**CASES, **AVOIDED}.items():
        try:
            kernel, pointers, constexprs, warps = build()
        except (ImportError, AttributeError, TypeError):  # not in this checkout's package
            continue
        r = compile_sm90(kernel, pointers, constexprs, warps)
        print(f"{plan:<28}{warps:>6}{r['REG']:>6}{r['STACK']:>7}{r['LOCAL']:>7}{r['sass']:>7}"
              f"{r['int ops']:>9}")


if __name__ == "__main__":
    main()
