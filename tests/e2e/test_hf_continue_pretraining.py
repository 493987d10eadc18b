"""A Hugging Face Llama with its own Llama-shaped tokenizer (``</s>`` as end of document, no
``<|endoftext|>``) continues pretraining from the commands ``hf-to-megatron`` prints.

Everything is built offline: the tokenizer with ``tokenizers``, the model with
``transformers``. The printed preprocess and pretrain commands are run as printed (only the
placeholder jsonl is written first and a short schedule appended), from a scratch directory.
"""

import json
import math
import os
import shlex
import subprocess
import sys

import tokenizers
from megatron.core.datasets.indexed_dataset import IndexedDataset

from pretrain_runner import REPO, read_metrics
from unit.convert.hf_models import convert, save_hf_model, save_llama_tokenizer

SHORT = ["--train-iters", "5", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--seq-length", "32", "--eval-iters", "1", "--eval-interval", "5", "--log-interval",
         "1", "--lr-warmup-iters", "1", "--run-dir", "run", "--no-save"]


def _printed_commands(out: str) -> list[list[str]]:
    """The commands hf-to-megatron printed (indented lines starting with python)."""
    lines = [line.strip() for line in out.splitlines() if line.startswith("  python")]
    return [shlex.split(line) for line in lines]


def _run(argv: list[str], cwd) -> subprocess.CompletedProcess:
    script = str(REPO / argv[1])  # tools/preprocess_data.py, pretrain_llama.py: repo-relative
    proc = subprocess.run([sys.executable, script, *argv[2:]], cwd=cwd, capture_output=True,
                          text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_converted_llama_trains_on_data_of_its_own_tokenizer(tmp_path, capsys):
    hf = tmp_path / "llama-hf"
    tok_path = save_llama_tokenizer(hf)
    hf_tok = tokenizers.Tokenizer.from_file(str(tok_path))
    save_hf_model("llama-gqa-untied", hf, vocab_size=hf_tok.get_vocab_size())
    assert convert("hf-to-megatron", "--hf-dir", hf, "--out", tmp_path / "llama-mg") == 0
    preprocess, train = _printed_commands(capsys.readouterr().out)
    assert preprocess[:2] == ["python", "tools/preprocess_data.py"]
    assert train[:2] == ["python", "pretrain_llama.py"] and str(tok_path) in train

    docs = [f"the cat number {i} sat on the mat" for i in range(1200)]
    (tmp_path / "my.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    _run(preprocess, tmp_path)
    data = IndexedDataset(str(tmp_path / "data/my_text_document"))
    eos = hf_tok.token_to_id("</s>")
    assert len(data) == len(docs) and all(data[i][-1] == eos for i in range(0, 1200, 97))

    _run([*train, *SHORT], tmp_path)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
