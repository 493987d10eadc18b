"""Test launcher: ``pretrain_precision.py`` that also counts the real FP8 GEMMs it ran (the
GEMM module's ``fp8_gemm``, wrapped) and prints ``real FP8 GEMMs: N`` at the end."""

import sys

from megatron_ext.precision import gemm, precision_extension
from megatron_ext.training.pretrain import main

_calls = []


def _counted(*args, _real=gemm.fp8_gemm, **kwargs):
    _calls.append(1)
    return _real(*args, **kwargs)


if __name__ == "__main__":  # dist_checkpointing spawns workers: keep the guard
    gemm.fp8_gemm = _counted
    code = main("llama", extensions=[precision_extension()])
    print(f"real FP8 GEMMs: {len(_calls)}", flush=True)
    sys.exit(code)
