"""Tiny Hugging Face checkpoints built with ``transformers`` (no downloads) for converter tests.

Imported as ``unit.convert.hf_models`` (``tests/`` is on ``sys.path``), also by the
distributed tests. Every parameter gets its own random values (norm weights and biases too),
so a mapping that swapped two tensors of equal shape could not go unnoticed.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_ext.convert.cli import main

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
"""Llama 3.1's rope scaling (its config.json values)."""

# vocab 300 pads to 384: also the padded size of the byte tokenizer pretrain uses with
# --mock-data (257 -> 384), so the converted models load into pretrain_*.py as they are.
MODELS = {
    "llama-gqa-untied": ("llama", {
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "tie_word_embeddings": False}),
    "llama-mha-tied": ("llama", {
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128,
        "rope_theta": 500000.0, "tie_word_embeddings": True}),
    "gpt2-tied": ("gpt2", {
        "vocab_size": 300, "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 64,
        "activation_function": "gelu"}),
    # GPT-2's default tanh GeLU -> --openai-gelu
    "gpt2-gelu-new": ("gpt2", {
        "vocab_size": 300, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "activation_function": "gelu_new"}),
    # Llama 3.1 rope scaling (megatron-core's fixed low/high factors and original context);
    # with theta 5e5 and head_dim 16, 4 of the 8 frequencies are scaled
    "llama3-rope-scaling": ("llama", {
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "rope_parameters": LLAMA3_ROPE}),
}


def save_hf_model(name: str, out: Path, dtype: torch.dtype = torch.float32,
                  max_shard_size: str | None = None, seed: int = 0, **overrides) -> Path:
    """``save_pretrained`` a randomly initialised model ``name`` (of MODELS) into ``out``."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    kind, config = MODELS[name]
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "gpt2": (GPT2Config, GPT2LMHeadModel)}[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**config, **overrides}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(out, **kwargs)
    return out


LLAMA_SPECIAL = ("<unk>", "<s>", "</s>")
"""Llama 2's special tokens, ids 0, 1, 2 (``</s>`` ends a document)."""


def save_llama_tokenizer(out: Path, vocab_size: int = 320) -> Path:
    """A Llama-2-shaped ``tokenizer.json`` in ``out``: BPE with byte fallback (``<0xNN>``),
    ``▁`` for spaces, ``<unk>`` / ``<s>`` / ``</s>`` at ids 0-2 and no ``<|endoftext|>``;
    trained offline on a few lines. Returns its path."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    special = [*LLAMA_SPECIAL, *(f"<0x{i:02X}>" for i in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  show_progress=False)
    tok.train_from_iterator([f"the cat number {i} sat on the mat and ate {7 * i} fish"
                             for i in range(200)], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in ``hf_dir``."""
    tensors = {}
    for path in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def convert(*argv) -> int:
    """Run ``tools/convert_checkpoint.py`` in this process; returns the exit status."""
    return main([str(a) for a in argv])


def convert_model(name: str, root: Path, dtype: torch.dtype = torch.float32) -> tuple[Path, Path]:
    """(HF dir, megatron checkpoint dir) of model ``name``, converted once under ``root``."""
    hf_dir, megatron_dir = root / name / "hf", root / name / "megatron"
    if not megatron_dir.exists():
        save_hf_model(name, hf_dir, dtype)
        assert convert("hf-to-megatron", "--hf-dir", hf_dir, "--out", megatron_dir) == 0
    return hf_dir, megatron_dir
