"""Cases for STQuant's fused Triton step on CPU under the Triton interpreter (not collected
directly: ``test_stquant_triton.py`` runs this file in a fresh process with
``TRITON_INTERPRET=1``): the kernel against the torch path, on ``fused_step_cases``' shards
and tolerance."""

import os

import pytest
from fused_step_cases import SHARDS, WIDTHS, check_against_the_torch_path

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_stquant_triton.py"

from megatron_ext.methods.stquant import triton_step  # noqa: E402


@pytest.mark.parametrize("old,new", WIDTHS)
@pytest.mark.parametrize("numel,lead,group", SHARDS)
def test_kernel_matches_the_torch_path_bit_for_bit(old, new, numel, lead, group):
    check_against_the_torch_path(triton_step.step, old, new, numel, lead, group)
