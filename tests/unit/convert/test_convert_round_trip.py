"""HF -> megatron -> HF gives back every tensor bit for bit and the same config.json."""

import json

import pytest
import torch
from megatron.core import dist_checkpointing
from unit.convert.hf_models import MODELS, convert, hf_tensors, save_hf_model

from megatron_ext.convert.hf_files import INDEX_FILE
from megatron_ext.convert.spec import SIDECAR
from megatron_ext.training.arguments import parse_args


def _assert_same_model(original, exported):
    a, b = hf_tensors(original), hf_tensors(exported)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
    config = json.loads((original / "config.json").read_text())
    assert json.loads((exported / "config.json").read_text()) == config


@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_through_sharded_files_is_bit_exact(name, tmp_path):
    hf = save_hf_model(name, tmp_path / "hf", max_shard_size="150KB")
    assert (hf / INDEX_FILE).exists()  # the reader follows the sharded index
    assert convert("hf-to-megatron", "--hf-dir", hf, "--out", tmp_path / "mg") == 0
    assert convert("megatron-to-hf", "--load", tmp_path / "mg", "--out", tmp_path / "back",
                   "--max-shard-size", "200KB") == 0
    assert (tmp_path / "back" / INDEX_FILE).exists()
    _assert_same_model(hf, tmp_path / "back")


def test_bf16_stays_bf16_loads_into_fp32_and_transformers_reads_the_export(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = save_hf_model("llama-gqa-untied", tmp_path / "hf", dtype=torch.bfloat16)
    assert convert("hf-to-megatron", "--hf-dir", hf, "--out", tmp_path / "mg") == 0
    ckpt = tmp_path / "mg" / "iter_0000000"
    dtypes = {sh.dtype for sh in dist_checkpointing.load_tensors_metadata(str(ckpt)).values()}
    assert dtypes == {torch.bfloat16}
    # the FP32 megatron model loads the BF16 tensors as they are, like transformers does
    assert convert("verify", "--hf-dir", hf, "--load", ckpt, "--atol", "1e-5") == 0
    assert convert("megatron-to-hf", "--load", ckpt, "--out", tmp_path / "back") == 0
    _assert_same_model(hf, tmp_path / "back")
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "back").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes  # not 0600
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.bfloat16)
    reference = hf_tensors(hf)
    assert all(torch.equal(t, reference[n]) for n, t in model.state_dict().items())


def test_sidecar_flags_parse_to_the_checkpoint_model(converted):
    _, megatron = converted("llama-gqa-untied")
    sidecar = json.loads((megatron / SIDECAR).read_text())
    args = parse_args(sidecar["family"], sidecar["flags"], world_size=1)
    assert (args.num_layers, args.num_attention_heads, args.num_query_groups) == (4, 4, 2)
    assert args.vocab_size == 300 and args.untie_embeddings_and_output_weights
    assert (megatron / "latest_checkpointed_iteration.txt").read_text() == "0\n"
    common = dist_checkpointing.load_common_state_dict(str(megatron / "iter_0000000"))
    assert common["weights_only"] is True  # pretrain --load takes it as --finetune
