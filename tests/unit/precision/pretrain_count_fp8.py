"""Test launcher: ``pretrain_precision.py`` that also counts the real FP8 GEMMs it ran (the
GEMM module's ``scaled_mm``, wrapped) and prints ``real FP8 GEMMs: N`` at the end."""

import sys

from megatron_ext.precision import gemm
from megatron_ext.precision.extension import precision_extension
from megatron_ext.training.pretrain import main

_calls = []


def _counted(*args, _real=gemm.scaled_mm, **kwargs):
    _calls.append(1)
    return _real(*args, **kwargs)


if __name__ == "__main__":  # dist_checkpointing spawns workers: keep the guard
    gemm.scaled_mm = _counted
    code = main("llama", extensions=[precision_extension()])
    print(f"real FP8 GEMMs: {len(_calls)}", flush=True)
    sys.exit(code)
