"""Tokenizers: round trips, EOD handling, errors."""

import json

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from megatron_ext.data.tokenizer import EOD_TOKEN, build_tokenizer

TEXT = 'def héllo(x):\n    return "✓ naïve" + x  # 日本語\n'


@pytest.mark.parametrize("name", [None, "byte"])
def test_byte_tokenizer_is_utf8_bytes_and_round_trips(name):
    tokenizer = build_tokenizer(name)
    ids = tokenizer.tokenize(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert tokenizer.detokenize(ids) == TEXT
    assert (tokenizer.vocab_size, tokenizer.eod) == (257, 256)
    assert tokenizer.detokenize([104, 105, 256]) == "hi" + EOD_TOKEN


def test_trained_tokenizer_round_trips_and_compresses(small_corpus):
    tokenizer = build_tokenizer(small_corpus.tokenizer_json)
    ids = tokenizer.tokenize(TEXT)
    assert tokenizer.detokenize(ids) == TEXT
    assert len(ids) < len(TEXT.encode("utf-8"))  # BPE merges: fewer ids than bytes
    assert max(ids) < tokenizer.vocab_size == 1024


def test_trained_tokenizer_eod_is_the_special_token(small_corpus):
    tokenizer = build_tokenizer(small_corpus.tokenizer_json)
    with open(small_corpus.tokenizer_json) as stream:
        added = {t["content"]: t["id"] for t in json.load(stream)["added_tokens"]}
    assert tokenizer.eod == added[EOD_TOKEN]
    # The literal text is not the token: only preprocessing (append_eod) emits EOD ids.
    literal = tokenizer.tokenize("a" + EOD_TOKEN + "b")
    assert tokenizer.eod not in literal
    assert tokenizer.detokenize(literal) == "a" + EOD_TOKEN + "b"


def test_unique_identifiers_are_json(small_corpus):
    tokenizer = build_tokenizer(small_corpus.tokenizer_json)
    assert json.loads(json.dumps(tokenizer.unique_identifiers))["eod"] == tokenizer.eod


def test_missing_tokenizer_file_is_a_one_line_error(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(FileNotFoundError) as info:
        build_tokenizer(str(missing))
    assert str(missing) in str(info.value) and "\n" not in str(info.value)


def test_tokenizer_without_eod_is_rejected(tmp_path):
    plain = tokenizers.Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel()
    plain.train_from_iterator(["abc abc"], trainer=trainers.BpeTrainer(vocab_size=300))
    plain.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="endoftext.*--eod-token"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))


def _llama_tokenizer(folder):
    from unit.convert.hf_models import save_llama_tokenizer

    return str(save_llama_tokenizer(folder))


def test_llama_tokenizer_ends_documents_with_its_eos(tmp_path):
    path = _llama_tokenizer(tmp_path)  # no <|endoftext|>; </s> is id 2
    tokenizer = build_tokenizer(path)
    assert (tokenizer.eod_token, tokenizer.eod) == ("</s>", 2)
    assert tokenizer.eod == tokenizers.Tokenizer.from_file(path).token_to_id("</s>")
    assert tokenizer.detokenize(tokenizer.tokenize("the cat ✓")) == "the cat ✓"


def test_tokenizer_config_eos_and_the_flag_choose_the_eod(tmp_path):
    path = _llama_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<s>", "special": True}}))
    assert build_tokenizer(path).eod == 1  # the config's eos_token, as Megatron-LM's HF one
    assert build_tokenizer(path, eod_token="<unk>").eod == 0  # --eod-token wins
    with pytest.raises(ValueError, match="--eod-token '<eot>'"):
        build_tokenizer(path, eod_token="<eot>")
    with pytest.raises(ValueError, match="byte tokenizer"):
        build_tokenizer("byte", eod_token="</s>")
