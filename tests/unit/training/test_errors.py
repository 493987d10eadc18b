"""Every bad-input case: one clear line on stderr, exit status 2, no traceback, no outputs."""

import os
import re
import subprocess
import sys

import pytest

from pretrain_runner import FAST_ARGS, REPO, free_port, launch
from megatron_ext.training.arguments import parse_args
from megatron_ext.errors import UsageError


def _run(args, env_extra=None, tmp_path=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    run_dir = ["--run-dir", str(tmp_path / "run")] if tmp_path else []
    return subprocess.run([sys.executable, str(REPO / "pretrain_llama.py"), *args, *run_dir],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=180)


def _assert_one_line_error(proc, fragment):
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert fragment in lines[0]
    assert "Traceback" not in proc.stderr


CASES = {
    "unknown preset": (["--model", "llama-9000"], 1, "unknown model preset 'llama-9000'"),
    "preset of the other family": (["--model", "gpt2-124m"], 1, "use pretrain_gpt.py"),
    "tp does not divide heads": (["--tensor-model-parallel-size", "2", "--num-attention-heads",
                                  "3", "--num-query-groups", "3", "--hidden-size", "96"],
                                 2, "does not divide --num-attention-heads 3"),
    "tp does not divide query groups": (["--tensor-model-parallel-size", "4"], 4,
                                        "does not divide --num-query-groups 2"),
    "pp does not divide layers": (["--pipeline-model-parallel-size", "3"], 3,
                                  "PP=3 does not divide --num-layers 4"),
    "world not divisible by tp*pp": (["--tensor-model-parallel-size", "2"], 1,
                                     "world size 1 is not divisible by TP*PP = 2"),
    "global batch not divisible": (["--micro-batch-size", "3", "--global-batch-size", "8"],
                                   1, "--global-batch-size 8 is not divisible"),
    "negative lr": (["--lr", "-1"], 1, "--lr and --min-lr must be >= 0"),
    "zero train iters": (["--train-iters", "0"], 1, "--train-iters must be positive"),
    "dropout out of range": (["--hidden-dropout", "1.5"], 1, "dropout must be in [0, 1)"),
    "seq longer than positions": (["--position-embedding-type", "learned_absolute",
                                   "--seq-length", "256"], 1, "exceeds --max-position"),
    "missing load dir": (["--load", "/nonexistent/ckpt"], 1, "does not exist"),
    "vp needs pp": (["--num-layers-per-virtual-pipeline-stage", "1"], 1, "needs PP > 1"),
    "sequence parallel needs tp": (["--sequence-parallel"], 1, "--sequence-parallel needs TP"),
    "rope scaling without rope": (["--use-rope-scaling", "--position-embedding-type",
                                   "learned_absolute"], 1, "--use-rope-scaling needs"),
    "rope scaling factor": (["--use-rope-scaling", "--rope-scaling-factor", "0"], 1,
                            "--rope-scaling-factor must be positive"),
    "distributed timeout not positive": (["--distributed-timeout-minutes", "0"], 1,
                                         "--distributed-timeout-minutes must be positive"),
    "openai gelu with swiglu": (["--openai-gelu"], 1, "--openai-gelu selects the GeLU"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_flags(name):
    args, world_size, fragment = CASES[name]
    with pytest.raises(UsageError, match=re.escape(fragment)):
        parse_args("llama", args, world_size=world_size)


def test_cli_bad_flag_is_one_line_and_exit_2(tmp_path):
    # as torchrun would start rank 0 of 3: the layout check fails before any rendezvous
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = _run(["--pipeline-model-parallel-size", "3"], env, tmp_path)
    _assert_one_line_error(proc, "PP=3 does not divide --num-layers 4")
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_data_path_without_tokenizer(tmp_path):
    proc = _run(["--data-path", "/tmp/x"], tmp_path=tmp_path)
    _assert_one_line_error(proc, "needs --tokenizer-model")


def test_missing_dataset(tmp_path):
    proc = _run(["--data-path", str(tmp_path / "nope_text_document"), "--tokenizer-model",
                 "byte", "--train-iters", "2"], tmp_path=tmp_path)
    _assert_one_line_error(proc, "nope_text_document")


@pytest.mark.parametrize("filename,content,fragment", [
    ("metadata.json", '{"sharded_backend": ', "cannot read checkpoint"),
    ("latest_checkpointed_iteration.txt", "garbage", "corrupt"),
])
def test_corrupt_checkpoint(tmp_path, filename, content, fragment):
    bad = tmp_path / "bad-ckpt"
    bad.mkdir()
    (bad / filename).write_text(content)
    proc = _run([*FAST_ARGS, "--train-iters", "2", "--load", str(bad), "--load-unverified"],
                tmp_path=tmp_path)
    _assert_one_line_error(proc, fragment)


def test_tp_not_dividing_padded_vocab(tmp_path):
    # byte vocabulary 257, padded to a multiple of 1 -> 257: odd, TP=2 cannot split it
    proc = launch([*FAST_ARGS, "--train-iters", "2", "--make-vocab-size-divisible-by", "1",
                   "--tensor-model-parallel-size", "2", "--run-dir", str(tmp_path / "r")],
                  nproc=2, check=False)
    assert proc.returncode != 0
    assert "error: TP=2 does not divide the padded vocabulary size 257" in proc.stderr
    assert "[rank0]: Traceback" not in proc.stderr  # torchrun's own report follows, ours not


def test_transformer_engine_impl_needs_te_and_gpu():
    from megatron_ext.training.layer_impl import resolve_transformer_impl
    assert resolve_transformer_impl("auto", custom_linears=False, te_available=False) == "local"
    with pytest.raises(UsageError, match="needs transformer_engine installed and a CUDA GPU"):
        resolve_transformer_impl("transformer_engine", custom_linears=False, te_available=False)
