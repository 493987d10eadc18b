"""``LlamaForCausalLM`` <-> megatron_ext's llama family (RMSNorm, SwiGLU, RoPE, GQA, no biases).

Hugging Face tensor -> megatron global key, with ``L`` = ``model.layers.{i}.`` and
``D`` = ``decoder.layers.`` (one megatron tensor holds every layer)::

    model.embed_tokens.weight (+ zero rows)         -> embedding.word_embeddings.weight
    L input_layernorm.weight                        -> D self_attention.linear_qkv.layer_norm_weight
    L self_attn.{q,k,v}_proj.weight (per group)     -> D self_attention.linear_qkv.weight
    L self_attn.o_proj.weight                       -> D self_attention.linear_proj.weight
    L post_attention_layernorm.weight               -> D mlp.linear_fc1.layer_norm_weight
    L mlp.gate_proj.weight ; L mlp.up_proj.weight   -> D mlp.linear_fc1.weight  ([gate; up])
    L mlp.down_proj.weight                          -> D mlp.linear_fc2.weight
    model.norm.weight                               -> decoder.final_layernorm.weight
    lm_head.weight (+ zero rows; untied only)       -> output_layer.weight
"""

from __future__ import annotations

from megatron_ext.convert.families import HFFamily, TensorMap, config_value, require
from megatron_ext.convert.transforms import concat_rows, pad_rows, qkv
from megatron_ext.training.errors import UsageError
from megatron_ext.training.presets import ModelArch

MAX_DEFAULT_SEQ_LENGTH = 4096
"""--seq-length suggested in the sidecar: the context length, capped (it is a training choice)."""


def _rope_theta(config: dict) -> float:
    """RoPE theta from transformers 5 ``rope_parameters`` or 4.x ``rope_theta``/``rope_scaling``."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") \
        or "default"
    if rope_type == "llama3":
        raise UsageError("rope scaling 'llama3' is not supported yet: megatron-core's GPTModel "
                         "implements it (rope_scaling=True, rope_scaling_factor) but "
                         "megatron_ext's model builder has no flag for it, so the model would "
                         "run unscaled")
    require(rope_type == "default", f"rope scaling '{rope_type}' is not supported "
                                    "(megatron-core implements only plain RoPE and llama3)")
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    require(theta.is_integer(), f"rope_theta {theta} is not an integer (megatron-core's GPTModel "
                                "takes an int rotary_base)")
    return theta


def read_config(config: dict) -> tuple[ModelArch, list[str]]:
    hidden = config_value(config, "hidden_size")
    heads = config_value(config, "num_attention_heads")
    head_dim = config.get("head_dim") or hidden // heads
    require(config.get("hidden_act", "silu") == "silu",
            f"hidden_act '{config.get('hidden_act')}' is not supported (SwiGLU needs silu)")
    require(not config.get("attention_bias") and not config.get("mlp_bias"),
            "attention_bias / mlp_bias are not supported (megatron_ext's llama has no biases)")
    require(head_dim * heads == hidden, f"head_dim {head_dim} x {heads} heads != hidden_size "
                                        f"{hidden} (megatron_ext uses head_dim = hidden / heads)")
    max_positions = config_value(config, "max_position_embeddings")
    arch = ModelArch(
        family="llama",
        num_layers=config_value(config, "num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=config_value(config, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        seq_length=min(max_positions, MAX_DEFAULT_SEQ_LENGTH),
        max_position_embeddings=max_positions,
        rotary_base=_rope_theta(config),
        norm_epsilon=config_value(config, "rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        vocab_size=config_value(config, "vocab_size"),
    )
    return arch, []


def write_config(arch: ModelArch) -> dict:
    theta = arch.rotary_base
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": arch.hidden_size, "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_query_groups,
        "head_dim": arch.hidden_size // arch.num_attention_heads,
        "max_position_embeddings": arch.max_position_embeddings, "rms_norm_eps": arch.norm_epsilon,
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": not arch.untie_embeddings_and_output_weights,
        "vocab_size": arch.vocab_size, "attention_bias": False, "mlp_bias": False,
    }


def tensor_maps(arch: ModelArch, padded_vocab: int) -> list[TensorMap]:
    hf, mg = "model.layers.{i}.", "decoder.layers."
    head_dim = arch.hidden_size // arch.num_attention_heads
    vocab = pad_rows(arch.vocab_size, padded_vocab)
    maps = [
        TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), vocab),
        TensorMap(mg + "self_attention.linear_qkv.layer_norm_weight",
                  (hf + "input_layernorm.weight",)),
        TensorMap(mg + "self_attention.linear_qkv.weight",
                  tuple(f"{hf}self_attn.{p}_proj.weight" for p in "qkv"),
                  qkv(arch.num_query_groups, head_dim)),
        TensorMap(mg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",)),
        TensorMap(mg + "mlp.linear_fc1.layer_norm_weight",
                  (hf + "post_attention_layernorm.weight",)),
        TensorMap(mg + "mlp.linear_fc1.weight",
                  (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), concat_rows(2)),
        TensorMap(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",)),
        TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if arch.untie_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), vocab))
    return maps


LLAMA = HFFamily(
    architecture="LlamaForCausalLM",
    model_type="llama",
    family="llama",
    read_config=read_config,
    write_config=write_config,
    tensor_maps=tensor_maps,
    ignored=(r"\.rotary_emb\.inv_freq$", r"^lm_head\.weight$"),
)
