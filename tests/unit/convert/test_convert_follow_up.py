"""What hf-to-megatron prints to continue pretraining: the model's own tokenizer, always.

The commands themselves are run in tests/e2e/test_hf_continue_pretraining.py."""

import shlex

from unit.convert.hf_models import convert, save_hf_model, save_llama_tokenizer


def _converted_output(tmp_path, capsys, vocab_size: int, tokenizer: bool) -> str:
    hf = tmp_path / "hf"
    if tokenizer:
        save_llama_tokenizer(hf)  # 320 tokens
    save_hf_model("llama-mha-tied", hf, vocab_size=vocab_size)
    capsys.readouterr()
    assert convert("hf-to-megatron", "--hf-dir", hf, "--out", tmp_path / "mg") == 0
    return capsys.readouterr().out


def _train_command(out: str) -> list[str]:
    return shlex.split(next(line for line in out.splitlines()
                            if line.startswith("  python pretrain_llama.py")))


def test_commands_use_the_hf_directorys_tokenizer(tmp_path, capsys):
    out = _converted_output(tmp_path, capsys, 320, tokenizer=True)
    train = _train_command(out)
    tokenizer = str(tmp_path / "hf" / "tokenizer.json")
    assert train[train.index("--tokenizer-model") + 1] == tokenizer
    assert train[train.index("--vocab-size") + 1] == "320"
    assert train[train.index("--data-path") + 1] == "data/my_text_document"
    assert f"--tokenizer-model {tokenizer} --append-eod" in out
    assert "note:" not in out and "warning:" not in out


def test_missing_tokenizer_json_is_said(tmp_path, capsys):
    out = _converted_output(tmp_path, capsys, 300, tokenizer=False)
    assert "--tokenizer-model TOKENIZER.json" in out
    assert "has no tokenizer.json; replace TOKENIZER.json" in out


def test_tokenizer_larger_than_the_model_is_warned_about(tmp_path, capsys):
    out = _converted_output(tmp_path, capsys, 300, tokenizer=True)
    assert "has 320 tokens, more than the model's vocabulary (300)" in out
