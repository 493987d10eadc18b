"""``LlamaForCausalLM`` <-> megatron_ext's llama family (RMSNorm, SwiGLU, RoPE, GQA, no biases).

RoPE: plain, or Llama 3.x scaling (``rope_type: llama3`` -> ``--use-rope-scaling
--rope-scaling-factor F``) when its other parameters are the ones megatron-core hard-codes.

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
from megatron_ext.training.presets import ModelArch

MAX_DEFAULT_SEQ_LENGTH = 4096
"""--seq-length suggested in the sidecar: the context length, capped (it is a training choice)."""

MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
"""What megatron-core's ``RotaryEmbedding._apply_scaling`` hard-codes for llama3 scaling (only
``factor`` is a ``GPTModel`` argument); a test reads them from megatron-core's signature."""


def _rope_parameters(config: dict) -> tuple[str, dict]:
    """(rope type, parameters) from transformers 5 ``rope_parameters`` or 4.x
    ``rope_theta`` / ``rope_scaling``."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    return rope_type, params


def _llama3_values(params: dict, config: dict) -> dict[str, float]:
    """llama3 ``factor`` and the parameters megatron-core fixes, as numbers (HF's default for
    ``original_max_position_embeddings`` is ``max_position_embeddings``)."""
    values = {"original_max_position_embeddings": config.get("max_position_embeddings"),
              **{k: params[k] for k in ("factor", *MEGATRON_LLAMA3) if k in params}}
    missing = [k for k in ("factor", *MEGATRON_LLAMA3) if values.get(k) is None]
    require(not missing, f"rope scaling 'llama3' has no {', '.join(missing)}")
    bad = [k for k, v in values.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    require(not bad, f"rope scaling 'llama3': {', '.join(bad)} must be a number")
    return {k: float(v) for k, v in values.items()}


def _llama3_factor(params: dict, config: dict) -> float:
    """``factor`` of llama3 scaling; UsageError if the other parameters are not megatron-core's
    fixed ones (the model would silently compute other frequencies)."""
    values = _llama3_values(params, config)
    differ = [f"{k} {values[k]:g} (megatron-core: {v:g})" for k, v in MEGATRON_LLAMA3.items()
              if values[k] != v]
    require(not differ, f"rope scaling 'llama3' with {', '.join(differ)} is not supported: "
                        "megatron-core fixes these values")
    require(values["factor"] > 0, f"rope scaling factor {values['factor']:g} must be > 0")
    return values["factor"]


def _rope(config: dict) -> tuple[float, float | None]:
    """(RoPE theta, llama3 scaling factor or None)."""
    rope_type, params = _rope_parameters(config)
    require(rope_type in ("default", "llama3"), f"rope scaling '{rope_type}' is not supported "
                                               "(megatron-core implements only plain RoPE and "
                                               "llama3)")
    factor = _llama3_factor(params, config) if rope_type == "llama3" else None
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    require(theta.is_integer(), f"rope_theta {theta} is not an integer (megatron-core's GPTModel "
                                "takes an int rotary_base)")
    return theta, factor


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
    theta, scaling_factor = _rope(config)
    arch = ModelArch(
        family="llama",
        num_layers=config_value(config, "num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=config_value(config, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        seq_length=min(max_positions, MAX_DEFAULT_SEQ_LENGTH),
        max_position_embeddings=max_positions,
        rotary_base=theta,
        use_rope_scaling=scaling_factor is not None,
        rope_scaling_factor=scaling_factor or ModelArch.rope_scaling_factor,
        norm_epsilon=config_value(config, "rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        vocab_size=config_value(config, "vocab_size"),
    )
    return arch, []


def _write_rope(arch: ModelArch) -> dict:
    """config.json's ``rope_parameters`` for ``arch``."""
    params = {"rope_type": "default", "rope_theta": arch.rotary_base}
    if arch.use_rope_scaling:
        params.update(rope_type="llama3", factor=arch.rope_scaling_factor, **MEGATRON_LLAMA3)
    return params


def write_config(arch: ModelArch) -> dict:
    theta = arch.rotary_base
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": arch.hidden_size, "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_query_groups,
        "head_dim": arch.hidden_size // arch.num_attention_heads,
        "max_position_embeddings": arch.max_position_embeddings, "rms_norm_eps": arch.norm_epsilon,
        "rope_theta": theta, "rope_parameters": _write_rope(arch),
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
