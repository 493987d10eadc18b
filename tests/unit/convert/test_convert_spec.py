"""config.json -> model flags (what pretrain would build), unsupported features refused."""

import dataclasses
import json

import pytest

from megatron_ext.convert.spec import (
    ModelSpec,
    family_named,
    read_spec_file,
    spec_from_hf_config,
    spec_from_run_args,
)
from megatron_ext.training.errors import UsageError

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
         "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192,
         "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
         "tie_word_embeddings": False}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257,
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 1024, "n_inner": None,
        "layer_norm_epsilon": 1e-5, "activation_function": "gelu"}


def _spec(config, **changes):
    return spec_from_hf_config({**config, **changes}, "bfloat16")


def test_llama_flags_build_the_same_model_in_pretrain():
    spec, warnings = _spec(LLAMA)
    args = spec.megatron_args(tp=2, pp=2)
    assert warnings == []
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (2, 64, 96)
    assert (args.num_attention_heads, args.num_query_groups) == (4, 2)
    assert args.rotary_base == 500000.0 and args.norm_epsilon == 1e-5
    assert args.swiglu and not args.add_bias_linear and args.untie_embeddings_and_output_weights
    assert args.normalization == "RMSNorm" and args.position_embedding_type == "rope"
    assert args.seq_length == 4096 and args.max_position_embeddings == 8192
    assert spec.padded_vocab_size == args.padded_vocab_size == 1024


def test_transformers4_rope_keys_are_read_too():
    config = {k: v for k, v in LLAMA.items() if k != "rope_parameters"}
    spec, _ = _spec(config, rope_theta=1e6, rope_scaling=None)
    assert spec.arch.rotary_base == 1e6
    assert _spec(config)[0].arch.rotary_base == 10000.0


def test_gpt2_flags_and_tied_embeddings():
    spec, warnings = _spec(GPT2)
    args = spec.megatron_args()
    assert warnings == [] and args.ffn_hidden_size == 256 and args.add_bias_linear
    assert args.position_embedding_type == "learned_absolute" and not args.swiglu
    assert not args.untie_embeddings_and_output_weights
    assert spec.padded_vocab_size == 50304


def test_gpt2_tanh_gelu_converts_with_a_warning():
    _, warnings = _spec(GPT2, activation_function="gelu_new")
    assert len(warnings) == 1 and "gelu_new" in warnings[0]


@pytest.mark.parametrize("config,changes,message", [
    (LLAMA, {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
     "unsupported architecture MistralForCausalLM"),
    (LLAMA, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "'llama3' is not supported yet"),
    (LLAMA, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}}, "'yarn'"),
    (LLAMA, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.5}},
     "not an integer"),
    (LLAMA, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    (LLAMA, {"attention_bias": True}, "attention_bias"),
    (LLAMA, {"head_dim": 32}, "head_dim 32"),
    (LLAMA, {"hidden_size": None}, "no 'hidden_size'"),
    (GPT2, {"activation_function": "relu"}, "'relu' is not supported"),
    (GPT2, {"scale_attn_by_inverse_layer_idx": True}, "attention scaling"),
])
def test_unsupported_configs_are_refused(config, changes, message):
    with pytest.raises(UsageError, match=message):
        _spec(config, **changes)


@pytest.mark.parametrize("tp,pp,message", [(3, 1, "TP=3 does not divide"),
                                           (1, 3, "PP=3 does not divide"),
                                           (4, 1, "TP=4 does not divide --num-query-groups 6")])
def test_layouts_the_model_cannot_run_at_are_refused(tp, pp, message):
    with pytest.raises(UsageError, match=message):
        _spec(LLAMA, num_attention_heads=12, num_key_value_heads=6, hidden_size=96)[0] \
            .megatron_args(tp, pp)


@pytest.mark.parametrize("config", [LLAMA, GPT2])
def test_generated_config_describes_the_same_model(config):
    spec, _ = _spec(config)
    family = family_named(spec.arch.family)
    back, _ = family.read_config(family.write_config(spec.arch))
    assert dataclasses.replace(back, seq_length=spec.arch.seq_length) == spec.arch


def test_spec_json_round_trip(tmp_path):
    spec, _ = _spec(GPT2)
    assert ModelSpec.from_json(spec.to_json()) == spec
    path = tmp_path / "megatron_model.json"
    path.write_text(json.dumps(spec.to_json()))
    assert read_spec_file(str(path)) == spec


def _run_args(**changes) -> dict:
    """What pretrain writes to args.json for this model (then ``changes``)."""
    return {**vars(_spec(LLAMA)[0].megatron_args()), **changes}


def test_a_run_trained_from_scratch_gets_a_generated_config():
    spec = spec_from_run_args(_run_args(bf16=False))
    assert spec.hf_config is None and spec.arch.vocab_size == 1024  # padding rows kept
    assert spec.config_json()["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(UsageError, match="not a LlamaForCausalLM: normalization=LayerNorm"):
        spec_from_run_args(_run_args(normalization="LayerNorm"))
