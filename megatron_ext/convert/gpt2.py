"""``GPT2LMHeadModel`` <-> megatron_ext's gpt family (LayerNorm, GeLU, learned positions, biases).

GPT-2's default ``gelu_new`` (and ``gelu_pytorch_tanh`` / ``gelu_fast``) is GeLU's tanh
approximation: ``--openai-gelu``; ``gelu`` is the exact GeLU.

GPT-2's linear layers are ``Conv1D`` modules whose weights are stored transposed
(``[in, out]``), and ``c_attn`` packs the projections as ``[q; k; v]``; megatron wants
``[out, in]`` and QKV rows grouped per head.

Hugging Face tensor -> megatron global key, with ``H`` = ``transformer.h.{i}.`` and
``D`` = ``decoder.layers.`` (``w/b``: weight and bias)::

    transformer.wte.weight (+ zero rows)      -> embedding.word_embeddings.weight
    transformer.wpe.weight                    -> embedding.position_embeddings.weight
    H ln_1.w/b                                -> D self_attention.linear_qkv.layer_norm_weight/bias
    H attn.c_attn.w (transposed) / .b         -> D self_attention.linear_qkv.weight/bias
    H attn.c_proj.w (transposed) / .b         -> D self_attention.linear_proj.weight/bias
    H ln_2.w/b                                -> D mlp.linear_fc1.layer_norm_weight/bias
    H mlp.c_fc.w (transposed) / .b            -> D mlp.linear_fc1.weight/bias
    H mlp.c_proj.w (transposed) / .b          -> D mlp.linear_fc2.weight/bias
    transformer.ln_f.w/b                      -> decoder.final_layernorm.weight/bias
    lm_head.weight (+ zero rows; untied only) -> output_layer.weight
"""

from __future__ import annotations

from megatron_ext.convert.families import HFFamily, TensorMap, config_value, require
from megatron_ext.convert.transforms import TRANSPOSE, compose, packed_qkv, pad_rows
from megatron_ext.training.presets import ModelArch

TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
"""GeLU's tanh approximation, under Hugging Face's names: megatron_ext's ``--openai-gelu``."""


def _openai_gelu(config: dict) -> bool:
    """Whether ``activation_function`` (default ``gelu_new``) is the tanh approximation."""
    activation = config.get("activation_function", "gelu_new")
    require(activation == "gelu" or activation in TANH_GELUS,
            f"activation_function '{activation}' is not supported")
    return activation in TANH_GELUS


def read_config(config: dict) -> tuple[ModelArch, list[str]]:
    require(not config.get("add_cross_attention"), "add_cross_attention is not supported")
    require(config.get("scale_attn_weights", True)
            and not config.get("scale_attn_by_inverse_layer_idx"),
            "only the standard 1/sqrt(head_dim) attention scaling is supported")
    hidden = config_value(config, "n_embd")
    heads = config_value(config, "n_head")
    positions = config_value(config, "n_positions")
    arch = ModelArch(
        family="gpt",
        num_layers=config_value(config, "n_layer"),
        hidden_size=hidden,
        ffn_hidden_size=config.get("n_inner") or 4 * hidden,
        num_attention_heads=heads,
        num_query_groups=heads,
        seq_length=positions,
        max_position_embeddings=positions,
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        norm_epsilon=config_value(config, "layer_norm_epsilon", 1e-5),
        swiglu=False,
        openai_gelu=_openai_gelu(config),
        add_bias_linear=True,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", True),
        vocab_size=config_value(config, "vocab_size"),
    )
    return arch, []


def write_config(arch: ModelArch) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "activation_function": "gelu_new" if arch.openai_gelu else "gelu",
        "n_embd": arch.hidden_size, "n_layer": arch.num_layers,
        "n_head": arch.num_attention_heads, "n_inner": arch.ffn_hidden_size,
        "n_positions": arch.max_position_embeddings, "layer_norm_epsilon": arch.norm_epsilon,
        "tie_word_embeddings": not arch.untie_embeddings_and_output_weights,
        "vocab_size": arch.vocab_size,
    }


def _conv1d(megatron: str, hf: str) -> list[TensorMap]:
    """A Conv1D layer: transposed weight, bias as is."""
    return [TensorMap(megatron + "weight", (hf + ".weight",), TRANSPOSE),
            TensorMap(megatron + "bias", (hf + ".bias",))]


def tensor_maps(arch: ModelArch, padded_vocab: int) -> list[TensorMap]:
    hf, mg = "transformer.h.{i}.", "decoder.layers."
    heads, head_dim = arch.num_attention_heads, arch.hidden_size // arch.num_attention_heads
    vocab = pad_rows(arch.vocab_size, padded_vocab)
    fused = packed_qkv(heads, head_dim)
    maps = [
        TensorMap("embedding.word_embeddings.weight", ("transformer.wte.weight",), vocab),
        TensorMap("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
        TensorMap(mg + "self_attention.linear_qkv.layer_norm_weight", (hf + "ln_1.weight",)),
        TensorMap(mg + "self_attention.linear_qkv.layer_norm_bias", (hf + "ln_1.bias",)),
        TensorMap(mg + "self_attention.linear_qkv.weight", (hf + "attn.c_attn.weight",),
                  compose(TRANSPOSE, fused)),
        TensorMap(mg + "self_attention.linear_qkv.bias", (hf + "attn.c_attn.bias",), fused),
        *_conv1d(mg + "self_attention.linear_proj.", hf + "attn.c_proj"),
        TensorMap(mg + "mlp.linear_fc1.layer_norm_weight", (hf + "ln_2.weight",)),
        TensorMap(mg + "mlp.linear_fc1.layer_norm_bias", (hf + "ln_2.bias",)),
        *_conv1d(mg + "mlp.linear_fc1.", hf + "mlp.c_fc"),
        *_conv1d(mg + "mlp.linear_fc2.", hf + "mlp.c_proj"),
        TensorMap("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
        TensorMap("decoder.final_layernorm.bias", ("transformer.ln_f.bias",)),
    ]
    if arch.untie_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), vocab))
    return maps


def canonical_name(name: str) -> str:
    """The original OpenAI-converted files name ``h.0...``; save_pretrained ``transformer.h.0``."""
    return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name


GPT2 = HFFamily(
    architecture="GPT2LMHeadModel",
    model_type="gpt2",
    family="gpt",
    read_config=read_config,
    write_config=write_config,
    tensor_maps=tensor_maps,
    canonical_name=canonical_name,
    ignored=(r"\.attn\.bias$", r"\.attn\.masked_bias$", r"^lm_head\.weight$"),
)
