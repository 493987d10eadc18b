"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (SDPA): the
``--attention-backend sdpa`` of megatron-core's local layers.

:class:`SDPAttention` is a drop-in for megatron-core's local ``DotProductAttention`` (same
constructor and ``forward`` contract, no parameters, so checkpoints do not change): it takes
``query [sq, b, np, hn]``, ``key`` / ``value [sk, b, ng, hn]`` (this TP rank's heads) and returns
``[sq, b, np*hn]``. Where the local path materialises the ``b x np x sq x sk`` scores and
probabilities (and keeps them for backward), SDPA dispatches to a fused kernel (flash /
memory-efficient on CUDA, torch's flash kernel on CPU) that keeps only the output and the
per-row log-sum-exp. Numerics match the local path:

* scale: ``softmax_scale`` (default ``1/sqrt(hn)``). ``apply_query_key_layer_scaling`` divides
  the local path's logits by the layer number and multiplies them back in an FP32 softmax; the
  net scale is the same, so SDPA uses it directly.
* softmax precision: the fused kernels accumulate the softmax in FP32 whatever the input dtype,
  i.e. at least ``attention_softmax_in_fp32``.
* masks: causal (``attn_mask_type`` causal, no mask given) -> ``is_causal``; a boolean
  megatron mask (True = masked out) is passed inverted; ``attention_bias`` is added to the
  logits (an additive float mask, with the causal / given mask as ``-inf``).
* GQA: ``enable_gqa`` where the fused kernel supports it (CPU, and FP16/BF16 on CUDA: flash);
  elsewhere key/value heads are repeated, as the local path does.
* dropout on the probabilities, under the model-parallel RNG tracker as in the local path
  (without sequence parallelism). On CPU torch's flash kernel has no dropout: with
  ``--attention-dropout > 0`` torch falls back to its math kernel there (``s x s`` kept).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SDPAttention(MegatronModule):
    """megatron-core ``DotProductAttention``'s contract on ``F.scaled_dot_product_attention``."""

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        if (config.context_parallel_size != 1 or config.softmax_type != "vanilla"
                or config.window_size is not None):
            raise ValueError("SDPAttention supports no context parallelism, sliding windows or "
                             "softmax offsets (use --attention-backend local)")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        """Query heads of this TP rank."""
        self.groups = divide(config.num_query_groups, tp)
        """Key/value heads of this TP rank."""
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else softmax_scale)
        self.dropout = (config.attention_dropout if attention_dropout is None
                        else attention_dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor],
                attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        """``[sq, b, np, hn]`` query, ``[sk, b, ng, hn]`` key/value -> ``[sq, b, np*hn]``."""
        assert packed_seq_params is None, "packed sequences need TEDotProductAttention"
        sq, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        gqa = self.groups != self.heads
        if gqa and q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
            # CUDA's memory-efficient kernel (FP32) has no GQA: torch would use its math kernel
            k, v = (t.repeat_interleave(self.heads // self.groups, dim=1) for t in (k, v))
            gqa = False
        mask, causal = sdpa_mask(attention_mask, attention_bias, self.attn_mask_type, q, k)
        dropout = self.dropout if self.training else 0.0
        kwargs = dict(attn_mask=mask, dropout_p=dropout, is_causal=causal,
                      scale=self.softmax_scale, enable_gqa=gqa)
        if dropout > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)


def sdpa_mask(attention_mask: Optional[torch.Tensor], bias: Optional[torch.Tensor],
              mask_type: AttnMaskType, q: torch.Tensor, k: torch.Tensor):
    """``(attn_mask, is_causal)`` for SDPA from megatron's boolean mask (True = masked out;
    it wins over ``mask_type``, as in the local path) and an additive ``bias``."""
    sq, sk = q.shape[2], k.shape[2]
    causal = attention_mask is None and mask_type == AttnMaskType.causal and sq > 1
    if bias is None:
        return (None if attention_mask is None else ~attention_mask), causal
    masked = attention_mask
    if causal:
        masked = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
    bias = bias.to(q.dtype)
    return (bias if masked is None else bias.masked_fill(masked, float("-inf"))), False
