"""Named model-size presets (``--model PRESET``); every field can be overridden by its flag."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArch:
    """Architecture of a decoder-only transformer: everything a size preset fixes."""

    family: str
    """``"llama"`` (RMSNorm, SwiGLU, RoPE, GQA, no biases) or ``"gpt"`` (LayerNorm, GeLU, biases)."""
    num_layers: int
    """Number of transformer layers (``--num-layers``)."""
    hidden_size: int
    """Model width (``--hidden-size``)."""
    ffn_hidden_size: int
    """MLP inner width (``--ffn-hidden-size``); for SwiGLU, the width of each of gate and up."""
    num_attention_heads: int
    """Query heads (``--num-attention-heads``)."""
    num_query_groups: int
    """Key/value heads for grouped-query attention (``--num-query-groups``); = heads for MHA."""
    seq_length: int
    """Training sequence length (``--seq-length``)."""
    max_position_embeddings: int
    """Largest position the model supports (learned-position table size for GPT)."""
    position_embedding_type: str = "rope"
    """``"rope"`` or ``"learned_absolute"`` (``--position-embedding-type``)."""
    rotary_base: float = 10000.0
    """RoPE theta (``--rotary-base``)."""
    use_rope_scaling: bool = False
    """Llama 3.x RoPE frequency scaling (``--use-rope-scaling``; megatron-core's fixed low / high
    frequency factors 1 / 4 and original context 8192)."""
    rope_scaling_factor: float = 8.0
    """Llama 3.x RoPE scaling factor (``--rope-scaling-factor``); used with ``use_rope_scaling``."""
    normalization: str = "RMSNorm"
    """``"RMSNorm"`` or ``"LayerNorm"`` (``--normalization``)."""
    norm_epsilon: float = 1e-5
    """Epsilon of the norm layers (``--norm-epsilon``)."""
    swiglu: bool = True
    """Gated SiLU MLP (Llama) instead of GeLU (GPT)."""
    openai_gelu: bool = False
    """GeLU's tanh approximation (``--openai-gelu``; Hugging Face GPT-2's ``gelu_new``) instead of
    the exact GeLU; GeLU MLPs only."""
    add_bias_linear: bool = False
    """Biases in the linear layers (GPT: yes, Llama: no)."""
    untie_embeddings_and_output_weights: bool = True
    """Separate input embedding and output projection (Llama); GPT-2 ties them."""
    vocab_size: int | None = None
    """Vocabulary size before padding; ``None`` takes the tokenizer's."""


def _llama(**kw) -> ModelArch:
    return ModelArch(family="llama", **kw)


def _gpt(**kw) -> ModelArch:
    defaults = dict(
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        swiglu=False,
        add_bias_linear=True,
        untie_embeddings_and_output_weights=False,
    )
    return ModelArch(family="gpt", **{**defaults, **kw})


PRESETS: dict[str, dict[str, ModelArch]] = {
    "llama": {
        "tiny": _llama(num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                       num_query_groups=2, seq_length=128, max_position_embeddings=128),
        "tinyllama-1.1b": _llama(num_layers=22, hidden_size=2048, ffn_hidden_size=5632,
                                 num_attention_heads=32, num_query_groups=4, seq_length=2048,
                                 max_position_embeddings=2048, vocab_size=32000),
        "llama2-7b": _llama(num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                            num_attention_heads=32, num_query_groups=32, seq_length=4096,
                            max_position_embeddings=4096, vocab_size=32000),
        "llama3-8b": _llama(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                            num_attention_heads=32, num_query_groups=8, seq_length=8192,
                            max_position_embeddings=8192, rotary_base=500000.0, vocab_size=128256),
        "llama3-70b": _llama(num_layers=80, hidden_size=8192, ffn_hidden_size=28672,
                             num_attention_heads=64, num_query_groups=8, seq_length=8192,
                             max_position_embeddings=8192, rotary_base=500000.0,
                             vocab_size=128256),
    },
    "gpt": {
        "tiny": _gpt(num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
                     num_query_groups=4, seq_length=128, max_position_embeddings=128),
        "gpt2-124m": _gpt(num_layers=12, hidden_size=768, ffn_hidden_size=3072,
                          num_attention_heads=12, num_query_groups=12, seq_length=1024,
                          max_position_embeddings=1024, vocab_size=50257),
        "gpt2-xl": _gpt(num_layers=48, hidden_size=1600, ffn_hidden_size=6400,
                        num_attention_heads=25, num_query_groups=25, seq_length=1024,
                        max_position_embeddings=1024, vocab_size=50257),
    },
}

ARCH_FIELDS = [f.name for f in dataclasses.fields(ModelArch) if f.name != "family"]


def preset_names() -> list[str]:
    return sorted({name for family in PRESETS.values() for name in family})


def get_preset(family: str, name: str) -> ModelArch:
    """The preset ``name`` of ``family``; ValueError (one line) if unknown or of another family."""
    if name in PRESETS[family]:
        return PRESETS[family][name]
    for other, presets in PRESETS.items():
        if name in presets:
            raise ValueError(f"preset '{name}' is a {other} model; use pretrain_{other}.py")
    raise ValueError(f"unknown model preset '{name}'; choose one of: {', '.join(preset_names())}")
