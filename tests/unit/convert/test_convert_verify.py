"""The converted model in megatron_ext computes Hugging Face's logits (FP32, TP = PP = 1).

Llama 3.1 rope scaling and GPT-2's tanh GeLU are exact too, and both matter: the same weights
under plain RoPE / the exact GeLU give other logits.

TP = 2 x PP = 2 is in tests/distributed/test_convert_parallel.py.
"""

import json
import re
import shutil

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


def test_llama3_rope_scaling_changes_the_logits(converted, capsys, tmp_path):
    _, megatron = converted("llama3-rope-scaling")
    plain = save_hf_model("llama3-rope-scaling", tmp_path / "plain", rope_parameters={
        "rope_type": "default", "rope_theta": 500000.0})  # same seed: the same weights
    status, diff = verified_difference(capsys, "--hf-dir", plain, "--load", megatron)
    assert status == 1 and diff > 1e-4


def test_gpt2_tanh_gelu_changes_the_logits(converted, capsys, tmp_path):
    hf, megatron = converted("gpt2-gelu-new")
    exact = shutil.copytree(hf, tmp_path / "exact")
    config = json.loads((exact / "config.json").read_text())
    (exact / "config.json").write_text(json.dumps({**config, "activation_function": "gelu"}))
    status, diff = verified_difference(capsys, "--hf-dir", exact, "--load", megatron,
                                       "--atol", "1e-5")
    assert status == 1 and diff > 1e-5


def test_both_models_land_on_the_given_device(converted):
    """On a GPU machine megatron-core builds its linears on the GPU but the torch norms on the
    CPU, and verify failed with "Expected all tensors to be on the same device". The device is
    now explicit: every parameter and buffer of the megatron model and of the Hugging Face
    model lands on it ('meta' stands in for a GPU on this CPU-only machine)."""
    import torch

    from megatron_ext.convert.megatron_files import build_model, megatron_runtime
    from megatron_ext.convert.spec import find_spec
    from megatron_ext.convert.verify import hf_model
    from megatron_ext.training.checkpointing import resolve_checkpoint_dir

    hf, megatron = converted("llama-gqa-untied")
    args = find_spec(resolve_checkpoint_dir(megatron, False), None).megatron_args()
    meta = torch.device("meta")
    with megatron_runtime(args):
        chunks = build_model(args, device=meta)
    for model in (chunks[0], hf_model(hf, meta)):
        tensors = [*model.parameters(), *model.buffers()]
        assert tensors and all(t.device == meta for t in tensors), type(model).__name__
