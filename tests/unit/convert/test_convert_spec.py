"""config.json -> model flags (what pretrain would build), unsupported features refused."""

import dataclasses
import inspect
import json

import pytest
from unit.convert.hf_models import LLAMA3_ROPE

from megatron_ext.convert.gpt2 import TANH_GELUS
from megatron_ext.convert.llama import MEGATRON_LLAMA3
from megatron_ext.convert.spec import (
    ModelSpec,
    family_named,
    read_spec_file,
    spec_from_hf_config,
    spec_from_run_args,
)
from megatron_ext.errors import UsageError

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


@pytest.mark.parametrize("activation", [*TANH_GELUS, "gelu"])
def test_gpt2_tanh_gelu_is_openai_gelu(activation):
    spec, warnings = _spec(GPT2, activation_function=activation)
    assert warnings == []
    assert spec.megatron_args().openai_gelu == (activation != "gelu")
    default = {k: v for k, v in GPT2.items() if k != "activation_function"}
    assert _spec(default)[0].arch.openai_gelu  # Hugging Face's default is gelu_new


def test_openai_gelu_is_hugging_faces_gelu_new():
    import torch
    from transformers.activations import NewGELUActivation

    from megatron_ext.training.model import activation_func

    x = torch.linspace(-6, 6, 1001)
    tanh_gelu = activation_func(_spec(GPT2, activation_function="gelu_new")[0].megatron_args())
    assert (tanh_gelu(x) - NewGELUActivation()(x)).abs().max() < 1e-6
    assert (torch.nn.functional.gelu(x) - NewGELUActivation()(x)).abs().max() > 1e-4


def test_llama3_rope_scaling_becomes_the_megatron_flags():
    spec, _ = _spec(LLAMA, rope_parameters={**LLAMA3_ROPE, "factor": 32.0})
    args = spec.megatron_args()
    assert args.use_rope_scaling and args.rope_scaling_factor == 32.0
    assert args.rotary_base == 500000.0
    assert not _spec(LLAMA)[0].megatron_args().use_rope_scaling


def test_transformers4_llama3_rope_scaling_is_read_too():
    config = {k: v for k, v in LLAMA.items() if k != "rope_parameters"}
    spec, _ = _spec(config, rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    assert spec.arch.use_rope_scaling and spec.arch.rope_scaling_factor == 8.0
    assert spec.arch.rotary_base == 5e5
    # without original_max_position_embeddings, HF uses max_position_embeddings (8192 here)
    params = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    assert _spec(LLAMA, rope_parameters=params)[0].arch.use_rope_scaling


def test_llama3_constants_are_megatron_cores():
    """What the converter accepts is what megatron-core's _apply_scaling hard-codes."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    defaults = {name: p.default for name, p in
                inspect.signature(RotaryEmbedding._apply_scaling).parameters.items()}
    assert {k: defaults[k] for k in MEGATRON_LLAMA3} == MEGATRON_LLAMA3


@pytest.mark.parametrize("config,changes,message", [
    (LLAMA, {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
     "unsupported architecture MistralForCausalLM"),
    (LLAMA, {"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 32}},
     r"'llama3' with original_max_position_embeddings 32 \(megatron-core: 8192\)"),
    (LLAMA, {"rope_parameters": {**LLAMA3_ROPE, "low_freq_factor": 2.0,
                                 "high_freq_factor": 8.0}},
     "low_freq_factor 2 .*, high_freq_factor 8 .* is not supported"),
    (LLAMA, {"max_position_embeddings": 131072, "rope_parameters": {
        k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}},
     "original_max_position_embeddings 131072"),
    (LLAMA, {"rope_parameters": {k: v for k, v in LLAMA3_ROPE.items() if k != "factor"}},
     "'llama3' has no factor"),
    (LLAMA, {"rope_parameters": {**LLAMA3_ROPE, "factor": "8"}}, "factor must be a number"),
    (LLAMA, {"rope_parameters": {**LLAMA3_ROPE, "factor": -2.0}}, "factor -2 must be > 0"),
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
        (_spec(LLAMA, num_attention_heads=12, num_key_value_heads=6, hidden_size=96)[0]
         .megatron_args(tp, pp))


@pytest.mark.parametrize("config", [LLAMA, GPT2, {**LLAMA, "rope_parameters": LLAMA3_ROPE},
                                    {**GPT2, "activation_function": "gelu_new"}])
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


def test_args_json_from_before_the_rope_and_gelu_flags_still_exports():
    old = {k: v for k, v in _run_args(bf16=False).items()
           if k not in ("use_rope_scaling", "rope_scaling_factor", "openai_gelu")}
    spec = spec_from_run_args(old)
    assert not spec.arch.use_rope_scaling and not spec.arch.openai_gelu
