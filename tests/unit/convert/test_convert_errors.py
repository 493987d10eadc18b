"""Bad input: one ``error:`` line, exit status 2, and nothing written."""

import json

import pytest
from unit.convert.hf_models import LLAMA3_ROPE, convert, save_hf_model

from megatron_ext.convert.hf_files import INDEX_FILE


def _edit_config(hf_dir, **changes):
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _delete_a_shard(hf_dir):
    weight_map = json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"]
    (hf_dir / max(weight_map.values())).unlink()


HF_CASES = {
    "wrong vocab": (lambda d: _edit_config(d, vocab_size=256), [],
                    "model.embed_tokens.weight [300, 64] does not match config.json"),
    "heads not divisible by TP": (None, ["--tensor-model-parallel-size", "3"],
                                  "TP=3 does not divide --num-attention-heads 4"),
    "unsupported architecture": (lambda d: _edit_config(d, architectures=["MixtralForCausalLM"],
                                                        model_type="mixtral"),
                                 [], "unsupported architecture MixtralForCausalLM"),
    "missing shard file": (_delete_a_shard, [],
                           "listed in model.safetensors.index.json is missing"),
    "layer missing": (lambda d: _edit_config(d, num_hidden_layers=5), [],
                      "has no tensor 'model.layers.4.input_layernorm.weight'"),
    "layer left over": (lambda d: _edit_config(d, num_hidden_layers=3), [],
                        "unexpected tensor 'model.layers.3."),
    "llama3 rope scaling megatron-core cannot compute": (lambda d: _edit_config(
        d, rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 32}), [],
        "'llama3' with original_max_position_embeddings 32 (megatron-core: 8192)"),
    "no weights": (lambda d: [p.unlink() for p in d.glob("*.safetensors*")], [],
                   "no model.safetensors or model.safetensors.index.json"),
}


def assert_refused(capsys, status: int, message: str, out) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_to_megatron_refuses(case, tmp_path, capsys):
    edit, flags, message = HF_CASES[case]
    hf = save_hf_model("llama-gqa-untied", tmp_path / "hf", max_shard_size="150KB")
    if edit:
        edit(hf)
    capsys.readouterr()
    out = tmp_path / "out"
    status = convert("hf-to-megatron", "--hf-dir", hf, "--out", out, *flags)
    assert_refused(capsys, status, message, out)


def test_an_existing_output_is_never_overwritten(converted, tmp_path, capsys):
    hf, _ = converted("gpt2-tied")
    out = tmp_path / "out"
    (out / "keep").mkdir(parents=True)
    status = convert("hf-to-megatron", "--hf-dir", hf, "--out", out)
    err = capsys.readouterr().err
    assert status == 2 and "already exists" in err and (out / "keep").is_dir()


def test_export_with_the_wrong_model_config_is_refused(converted, tmp_path, capsys):
    _, llama = converted("llama-gqa-untied")
    _, gpt2 = converted("gpt2-tied")
    out = tmp_path / "out"
    status = convert("megatron-to-hf", "--load", llama, "--out", out,
                     "--model-config", gpt2 / "megatron_model.json")
    assert_refused(capsys, status, "the checkpoint has no tensor", out)


def test_verify_of_a_missing_checkpoint_is_refused(converted, tmp_path, capsys):
    hf, _ = converted("gpt2-tied")
    status = convert("verify", "--hf-dir", hf, "--load", tmp_path / "nowhere")
    assert_refused(capsys, status, "does not exist", tmp_path / "out")


def test_verify_against_a_model_of_another_vocabulary_is_one_line(converted, tmp_path,
                                                                 capsys):
    _, ckpt = converted("llama-gqa-untied")
    other = save_hf_model("llama-gqa-untied", tmp_path / "hf256", vocab_size=256)
    capsys.readouterr()
    status = convert("verify", "--hf-dir", other, "--load", ckpt)
    assert_refused(capsys, status, "describes another model than --load: vocab_size 256 "
                                   "there, 300 in the checkpoint", tmp_path / "out")
