"""Which layer implementation a run gets: one pure decision, asked by the real run
(``pretrain.setup``) and by ``--dry-run`` alike, so the two cannot drift apart.

``--transformer-impl auto`` means Transformer Engine when it can run, no extension swaps
the linears and no local attention backend is asked for (the precision platform's quantized linears need megatron-core's local layers);
the real run asks the machine whether TE can run, the dry run assumes the GPU node the job is
meant for (TE installed, ``Dockerfile``'s NGC image).
"""

from __future__ import annotations

import importlib.util

from megatron_ext.errors import UsageError
from megatron_ext.training.attention_backend import LOCAL_BACKENDS


def transformer_engine_available() -> bool:
    """TE importable and a GPU to run it on (this machine)."""
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def resolve_transformer_impl(requested: str, custom_linears: bool, te_available: bool,
                             attention_backend: str = "auto") -> str:
    """``(--transformer-impl, an extension returns linear classes?, TE can run?,
    --attention-backend)`` -> ``local`` or ``transformer_engine``; ``UsageError`` for a request
    the job would refuse. ``auto`` takes the local layers also when the attention backend is
    one of theirs (``sdpa`` / ``local``)."""
    if requested == "auto":
        local = custom_linears or attention_backend in LOCAL_BACKENDS
        return "transformer_engine" if te_available and not local else "local"
    if requested == "transformer_engine":
        if not te_available:
            raise UsageError("--transformer-impl transformer_engine needs transformer_engine "
                             "installed and a CUDA GPU")
        if custom_linears:
            raise UsageError("--transformer-impl transformer_engine uses TE's fused layers; "
                             "per-layer precision needs --transformer-impl local")
    return requested
