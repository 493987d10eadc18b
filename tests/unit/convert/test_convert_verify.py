"""The converted model in megatron_ext computes Hugging Face's logits (FP32, TP = PP = 1).

TP = 2 x PP = 2 is in tests/distributed/test_convert_parallel.py.
"""

import re

import pytest
from unit.convert.hf_models import MODELS, convert, save_hf_model


def verified_difference(capsys, *argv) -> tuple[int, float]:
    """(exit status, max |logits difference|) of one ``verify`` run."""
    status = convert("verify", *argv)
    match = re.search(r"Hugging Face: (\S+) on", capsys.readouterr().out)
    assert match, "verify printed no result"
    return status, float(match.group(1))


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_hugging_face(name, converted, capsys):
    hf, megatron = converted(name)
    status, diff = verified_difference(capsys, "--hf-dir", hf, "--load", megatron,
                                       "--atol", "1e-5")
    assert status == 0 and diff <= 1e-5


def test_verify_fails_for_other_weights(converted, capsys, tmp_path):
    _, megatron = converted("llama-gqa-untied")
    other = save_hf_model("llama-gqa-untied", tmp_path / "other", seed=1)
    status, diff = verified_difference(capsys, "--hf-dir", other, "--load", megatron)
    assert status == 1 and diff > 1e-2
