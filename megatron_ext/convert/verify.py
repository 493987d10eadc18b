"""``verify``: the converted megatron model and the Hugging Face model give the same logits.

Both models run in FP32 on the same random tokens, on the device pretrain would use (CPU /
gloo here, this rank's GPU / NCCL on a GPU machine: the megatron model and the Hugging Face
model on the same device; the logits are compared on the CPU). The megatron side is the real thing:
the model pretrain builds, at the requested TP x PP (one torchrun rank each), its weights loaded
from the checkpoint by dist_checkpointing, and its forward pass driven by megatron-core's
pipeline schedule. The last pipeline stage gathers the vocab-parallel logits; one rank runs
the Hugging Face model (``transformers``) and every rank learns the max absolute difference.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_ext.convert.megatron_files import (
    build_model,
    load_weights,
    megatron_runtime,
)
from megatron_ext.convert.spec import ModelSpec
from megatron_ext.errors import UsageError


def random_tokens(vocab_size: int, batch: int, seq_length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_length), generator=generator)


@torch.no_grad()
def megatron_logits(chunks: list, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """[batch, seq, vocab] logits on the last pipeline stage (None elsewhere)."""
    device = next(chunks[0].parameters()).device
    tokens = tokens.to(device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)

    def forward_step(data_iterator, model):  # no loss function: the schedule returns outputs
        return model(next(data_iterator), positions, None), None

    for chunk in chunks:
        chunk.eval()
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([tokens]),
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=1, seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
        forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(outputs[0])[..., :vocab_size].float().cpu()


def hf_model(hf_dir: str, device: torch.device) -> torch.nn.Module:
    """The Hugging Face model of ``hf_dir`` in FP32 eval mode, on ``device``."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging
    except ImportError:
        raise UsageError("verify needs the transformers package (see docs/convert.md)") from None
    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval().to(device)


@torch.no_grad()
def hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """[batch, seq, vocab] FP32 logits on the CPU, computed on ``model``'s device."""
    return model(tokens.to(next(model.parameters()).device)).logits.float().cpu()


def verify(spec: ModelSpec, hf_dir: str, ckpt_dir: str, tp: int = 1, pp: int = 1,
           batch: int = 2, seq_length: int = 32, seed: int = 1234) -> float:
    """Max |megatron logits - HF logits| (collective: every rank of the TP x PP job calls it)."""
    seq_length = min(seq_length, spec.arch.max_position_embeddings)
    args = spec.megatron_args(tp, pp, ["--micro-batch-size", str(batch), "--seq-length",
                                       str(seq_length), "--distributed-backend", "auto"])
    tokens = random_tokens(spec.arch.vocab_size, batch, seq_length, seed)
    with megatron_runtime(args):
        chunks = build_model(args)
        load_weights(chunks, ckpt_dir)
        logits = megatron_logits(chunks, tokens, spec.arch.vocab_size)
        device = next(chunks[0].parameters()).device
        diff = torch.zeros(1, dtype=torch.float64, device=device)
        if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
            diff[0] = (logits - hf_logits(hf_model(hf_dir, device), tokens)).abs().max().item()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def write_result(path: str, diff: float) -> None:
    """Hand the result to the process that launched torchrun."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"max_abs_diff": diff}, f)
