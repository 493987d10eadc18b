"""FSDP2 checkpoint layout: the SwiGLU fc1 block -> global fragment map, checked by brute force."""

import pytest
import torch

from megatron_ext.training.fsdp_checkpoint import swiglu_block_fragment


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4, 6])
def test_fc1_block_is_the_global_fragment_the_map_names(tp, dp):
    rows = tp * dp  # gate rows F: each FSDP2 block then holds 2F/(tp·dp) = 2 rows
    gate, up = torch.arange(rows), torch.arange(rows, 2 * rows)
    full = torch.cat([gate, up])  # the checkpoint's global [gate; up]
    block = 2 * rows // (tp * dp)
    seen = set()
    for t in range(tp):
        local = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])  # megatron's TP-local fc1
        for d in range(dp):
            mine = local[d * block:(d + 1) * block]  # what FSDP2 leaves on DP rank d
            fragment = swiglu_block_fragment(t, tp, d, dp)
            assert torch.equal(mine, full[fragment * block:(fragment + 1) * block])
            seen.add(fragment)
    assert seen == set(range(tp * dp))  # every global row written exactly once
