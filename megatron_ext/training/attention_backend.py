"""``--attention-backend``: its choices and how ``auto`` resolves (kept free of megatron-core
imports: the flag parser reads it)."""

from __future__ import annotations

from megatron_ext.errors import UsageError

LOCAL_BACKENDS = ("sdpa", "local")
"""``--attention-backend`` choices that run in megatron-core's local layers."""
TE_BACKENDS = ("flash", "fused", "unfused")
"""Transformer Engine's attention backends (megatron-core ``AttnBackend``; TE layers only)."""
CHOICES = ("auto",) + LOCAL_BACKENDS + TE_BACKENDS
"""Every ``--attention-backend`` choice."""


def resolve_attention_backend(requested: str, transformer_impl: str) -> str:
    """``auto`` -> ``sdpa`` in local layers, TE's own choice (``auto``) in TE layers; refuses a
    backend the layers cannot run, in one line."""
    if transformer_impl == "transformer_engine":
        if requested in LOCAL_BACKENDS:
            raise UsageError(f"--attention-backend {requested} runs in megatron-core's local "
                             "layers: add --transformer-impl local")
        return requested
    if requested in TE_BACKENDS:
        raise UsageError(f"--attention-backend {requested} is Transformer Engine's: it needs "
                         "--transformer-impl transformer_engine (TE installed, a CUDA GPU)")
    return "sdpa" if requested == "auto" else requested
