"""What ``hf-to-megatron`` prints after a conversion: the commands that continue pretraining.

A converted model's embedding rows mean the tokens of the model's own tokenizer, so the
commands preprocess the user's data with the ``tokenizer.json`` of the Hugging Face directory
and train with it (the default corpus' 4096-token BPE would map other text to those rows).
"""

from __future__ import annotations

import os
import shlex

from megatron_ext.convert.spec import SIDECAR, ModelSpec
from megatron_ext.data.tokenizer import build_tokenizer

DATA_INPUT = "my.jsonl"
"""The placeholder for the user's JSON-lines file in the printed preprocess command."""
DATA_PREFIX = "data/my"
"""``--output-prefix`` of the printed preprocess command (the dataset is ``data/my_text_document``)."""


def _tokenizer_flags(hf_dir: str, vocab_size: int) -> tuple[list[str], str]:
    """(``--tokenizer-model`` and, where needed, ``--eod-token`` flags; a note, or '')."""
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return (["--tokenizer-model", "TOKENIZER.json"],
                f"note: '{hf_dir}' has no tokenizer.json; replace TOKENIZER.json by the "
                "tokenizer the model was trained with")
    try:
        tokenizer = build_tokenizer(path)
    except ValueError:
        return (["--tokenizer-model", path, "--eod-token", "EOD"],
                f"note: {path} names no end-of-document token; replace EOD by its text")
    if tokenizer.vocab_size > vocab_size:
        return (["--tokenizer-model", path],
                f"warning: {path} has {tokenizer.vocab_size} tokens, more than the model's "
                f"vocabulary ({vocab_size}): pretrain will refuse it")
    return ["--tokenizer-model", path], ""


def follow_up(spec: ModelSpec, hf_dir: str, out: str, tp: int, pp: int) -> str:
    """The lines printed after a conversion: model flags, then the two commands to run."""
    script = f"pretrain_{spec.arch.family}.py"
    launch = (["python", script] if tp * pp == 1
              else ["torchrun", "--nproc-per-node", str(tp * pp), script])
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    tok, note = _tokenizer_flags(hf_dir, spec.arch.vocab_size)
    preprocess = ["python", "tools/preprocess_data.py", "--input", DATA_INPUT,
                  "--output-prefix", DATA_PREFIX, *tok, "--append-eod"]
    train = [*launch, "--load", out, *layout, *spec.flags(),
             "--data-path", f"{DATA_PREFIX}_text_document", *tok]
    return (f"model flags (also in {os.path.join(out, SIDECAR)}):\n  {shlex.join(spec.flags())}\n"
            f"continue pretraining on your data ({DATA_INPUT}: one JSON object with a 'text' "
            "key per line), tokenized with the model's own tokenizer:\n"
            f"  {shlex.join(preprocess)}\n  {shlex.join(train)}" + (f"\n{note}" if note else ""))
