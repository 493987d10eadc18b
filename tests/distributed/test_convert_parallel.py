"""Converted checkpoints at TP = 2 x PP = 2 (torchrun on gloo, 4 processes).

The logits match Hugging Face's at that layout, and ``pretrain_llama.py`` resumes from a
conversion there (flags from the sidecar), trains, and saves a TP2 x PP2 checkpoint that
``megatron-to-hf`` exports back bit for bit (the learning rate is 0, so the weights must come
out exactly as they went in).
"""

import json
import re

import pytest
from pretrain_runner import FAST_ARGS, launch, train_losses
from unit.convert.hf_models import convert, convert_model, hf_tensors

from megatron_ext.convert.spec import SIDECAR

LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    return lambda name: convert_model(name, root)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "gpt2-tied"])
def test_logits_match_hugging_face_at_tp2_pp2(name, converted, capsys):
    hf, megatron = converted(name)
    status = convert("verify", "--hf-dir", hf, "--load", megatron, "--atol", "1e-5", *LAYOUT)
    match = re.search(r"\(TP=2, PP=2\) vs Hugging Face: (\S+) on", capsys.readouterr().out)
    assert status == 0 and match and float(match.group(1)) <= 1e-5


def test_pretrain_resumes_at_tp2_pp2_and_its_checkpoint_exports_back(converted, tmp_path):
    hf, megatron = converted("llama-gqa-untied")
    flags = json.loads((megatron / SIDECAR).read_text())["flags"]
    run, save = tmp_path / "run", tmp_path / "ckpt"
    launch([*flags, *FAST_ARGS, *LAYOUT, "--load", str(megatron), "--train-iters", "2",
            "--lr", "0", "--min-lr", "0", "--run-dir", str(run), "--save", str(save)], nproc=4)
    assert sorted(train_losses(run)) == [1, 2]
    assert convert("megatron-to-hf", "--load", save, "--out", tmp_path / "back",
                   "--model-config", megatron / SIDECAR) == 0
    original, exported = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert sorted(original) == sorted(exported)
    assert all(original[n].equal(exported[n]) for n in original)
