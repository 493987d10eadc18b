"""FSDP2: the checkpoint's SwiGLU fc1 block -> global fragment map (brute force), and the
flag rules (Megatron-LM's own for FSDP2)."""

import re

import pytest
import torch

from megatron_ext.errors import UsageError
from megatron_ext.training.arguments import parse_args
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


@pytest.mark.parametrize("family, flags, message", [
    ("gpt", [], "--use-torch-fsdp2 needs --untie-embeddings-and-output-weights"),
    ("llama", ["--use-distributed-optimizer"], "drop --use-distributed-optimizer"),
    ("llama", ["--use-megatron-fsdp"], "exclude each other"),
])
def test_fsdp2_flag_rules(family, flags, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_args(family, ["--use-torch-fsdp2", *flags])


def test_untied_gpt_is_accepted():
    args = parse_args("gpt", ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"])
    assert args.use_torch_fsdp2 and args.untie_embeddings_and_output_weights
