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
    # operations round 2 (issue 25)
    "infinite lr": (["--lr", "inf"], 1, "argument --lr: must be a finite number, not 'inf'"),
    "nan min lr": (["--min-lr", "nan"], 1, "argument --min-lr: must be a finite number"),
    "infinite extension flag": (["--snip-budget", "inf"], 1, "argument --snip-budget: must be "
                                                              "a finite number"),
    "negative lr in exponent form": (["--lr", "-1e-3"], 1, "--lr and --min-lr must be >= 0"),
    "unknown flag": (["--bogus"], 1, "unrecognized arguments: --bogus"),
    "heads vs the preset's query groups": (["--num-attention-heads", "3"], 1,
                                           "--num-query-groups 2 (the --model tiny preset's) "
                                           "does not divide --num-attention-heads 3"),
    "global batch zero": (["--global-batch-size", "0"], 1, "--global-batch-size must be positive"),
    "split not numbers": (["--split", "abc"], 1, "--split 'abc': expected train,valid,test"),
    "split without train": (["--split", "0,1,0"], 1, "--split '0,1,0': expected"),
    "split of four": (["--split", "1,1,1,1"], 1, "--split '1,1,1,1': expected"),
    "exit interval zero": (["--exit-interval", "0"], 1, "--exit-interval must be positive"),
    "save interval zero": (["--save-interval", "0"], 1, "--save-interval must be positive"),
    "stquant flag without its optimizer": (["--stquant-fixed-bits", "4"], 1,
                                           "--stquant-fixed-bits is a flag of stquant, which "
                                           "is off: it needs --optimizer stquant-adamw"),
    "fp8 execution without a plan": (["--fp8-execution", "real"], 1,
                                     "--fp8-execution is a flag of precision, which is off: "
                                     "it needs --precision POLICY or --precision-plan"),
    "snip under megatron fsdp": (["--precision", "snip", "--use-megatron-fsdp"], 1,
                                 "snip does not run with --use-megatron-fsdp: its statistics"),
    "gnmr under torch fsdp2": (["--precision", "uniform:fp8", "--gnmr", "--use-torch-fsdp2"],
                               1, "gnmr does not run with --use-torch-fsdp2: it reads"),
    "keep more bf16 layers than the model has": (["--precision", "uniform:fp4",
                                                  "--keep-first-last-layers-bf16", "10"], 1,
                                                 "--keep-first-last-layers-bf16 10: the model "
                                                 "has 4 layers"),
    # operations round 3 (issue 41)
    "rotary base zero": (["--rotary-base", "0"], 1, "--rotary-base 0 must be positive"),
    "norm epsilon negative": (["--norm-epsilon=-1"], 1, "--norm-epsilon -1 must be positive"),
    "init std negative": (["--init-method-std=-0.02"], 1, "--init-method-std -0.02 must be "
                                                          "positive"),
    "vocab padding zero": (["--make-vocab-size-divisible-by", "0"], 1,
                           "--make-vocab-size-divisible-by 0 must be positive"),
    "no-save with save": (["--no-save", "--save", "X"], 1, "--no-save and --save X exclude"),
    "empty run dir": (["--run-dir", ""], 1, "--run-dir '': give a folder"),
    "empty save": (["--save", ""], 1, "--save '': give a folder"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_flags(name):
    args, world_size, fragment = CASES[name]
    with pytest.raises(UsageError, match=re.escape(fragment)):
        _validated(args, world_size)


def _validated(argv, world_size):
    """What pretrain_llama.py checks before any work: the trainer's, the dry run's and every
    extension's flags, parsed, then each extension's ``validate``."""
    from megatron_ext.defaults import default_extensions
    from megatron_ext.extension import (args_provider, hooks, refuse_conflicts,
                                        refuse_inactive_flags)
    from megatron_ext.training import dry_run

    extensions = default_extensions()
    args = parse_args("llama", argv, dry_run.args_provider(args_provider(extensions)),
                      world_size=world_size)
    refuse_inactive_flags(extensions, args, set(argv))
    refuse_conflicts(extensions, args)
    for validate in hooks(extensions, "validate"):
        validate(args)


def test_flags_accept_negative_numbers_in_exponent_form():
    args = parse_args("llama", ["--adam-eps", "1e-8", "--init-method-std", "2e-2"],
                      world_size=1)
    assert args.adam_eps == 1e-8
    with pytest.raises(UsageError, match="--clip-grad and --weight-decay >= 0"):
        parse_args("llama", ["--weight-decay", "-1e-2"], world_size=1)  # a value, not a flag


START_UP_CASES = {  # refused by pretrain() before any process group or file is made
    "dry-run json under a file": (["--dry-run", "--dry-run-json", "{file}/r.json"],
                                  "--dry-run-json: cannot write"),
    "data cache under a file": (["--mock-data", "--data-cache-path", "{file}/cache"],
                                "--data-cache-path: cannot write '{file}/cache'"),
    "sequence no machine holds": (["--seq-length", "100000000"],
                                  "--seq-length 100000000, --micro-batch-size 8"),
    "steps whose index no machine holds": (["--train-iters", str(10**12)],
                                           f"--train-iters {10**12} x --global-batch-size 8"),
    "index cache beside the data unwritable": (["--data-path", "{file}", "--tokenizer-model",
                                                "byte"],
                                               "--data-path {file}: its index cache beside it "
                                               "(pass --data-cache-path to put it elsewhere): "
                                               "cannot write '{file}/cache/GPTDataset_indices'"),
}


@pytest.mark.parametrize("name", list(START_UP_CASES))
def test_bad_outputs_refused_at_start_up(name, tmp_path):
    from megatron_ext.defaults import default_extensions
    from megatron_ext.training.pretrain import pretrain

    afile = tmp_path / "afile"
    afile.write_text("")
    args, fragment = START_UP_CASES[name]
    argv = [a.format(file=afile) for a in args] + ["--run-dir", str(tmp_path / "run")]
    with pytest.raises(UsageError, match=re.escape(fragment.format(file=afile))):
        pretrain("llama", argv, default_extensions())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_cli_bad_flag_is_one_line_and_exit_2(tmp_path):
    # as torchrun would start rank 0 of 3: the layout check fails before any rendezvous
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = _run(["--pipeline-model-parallel-size", "3"], env, tmp_path)
    _assert_one_line_error(proc, "PP=3 does not divide --num-layers 4")
    assert not (tmp_path / "run").exists()  # nothing half-written
    proc = _run(["--lr", "inf", "--bogus"], tmp_path=tmp_path)  # argparse's own errors
    _assert_one_line_error(proc, "error: argument --lr: must be a finite number, not 'inf'")
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # no usage text


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


def _two_short_documents(folder):
    """Two documents of a few bytes, preprocessed as the README says (byte tokenizer, EOD)."""
    from megatron_ext.data.preprocess import PreprocessConfig, preprocess

    folder.mkdir()
    (folder / "two.jsonl").write_text('{"text": "hello world"}\n{"text": "second doc"}\n')
    return preprocess(PreprocessConfig(input=str(folder / "two.jsonl"),
                                       output_prefix=str(folder / "two"), append_eod=True),
                      log=None).prefixes["text"]


def test_dataset_too_small_for_its_split_is_one_line_not_a_hang(tmp_path):
    prefix = _two_short_documents(tmp_path / "data")
    proc = _run(["--data-path", prefix, "--tokenizer-model", "byte", "--train-iters", "2"],
                tmp_path=tmp_path)  # megatron-core looped forever here (timeout: 180 s)
    _assert_one_line_error(proc, f"--data-path {prefix}: --split 969,30,1 gives the validation "
                                 "split none of its 2 documents; it needs 17 or more")
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "two.jsonl", "two_text_document.bin", "two_text_document.idx"]  # no index cache left


def _data_args(tmp_path, *flags):
    return parse_args("llama", [*flags, "--split", "1,0,0", "--eval-iters", "0",
                                "--run-dir", str(tmp_path / "run")], world_size=1)


def test_tokenizer_file_that_is_not_a_tokenizer_json(tmp_path):
    from megatron_ext.training.data import build_data

    prefix = _two_short_documents(tmp_path / "data")
    (tmp_path / "tok.json").write_text("not json at all")
    with pytest.raises(UsageError, match=r"^--tokenizer-model: '.*tok.json' is not a "
                                         r"tokenizers tokenizer.json \(.+\)$"):
        build_data(_data_args(tmp_path, "--data-path", prefix, "--tokenizer-model",
                              str(tmp_path / "tok.json")))


def test_data_of_a_larger_vocabulary_than_the_tokenizer(tmp_path):
    import tokenizers
    from tokenizers.models import WordLevel

    from megatron_ext.training.data import build_data

    prefix = _two_short_documents(tmp_path / "data")  # byte ids up to 256 (EOD)
    small = tokenizers.Tokenizer(WordLevel({"<|endoftext|>": 0, "a": 1, "<unk>": 2},
                                           unk_token="<unk>"))
    small.save(str(tmp_path / "small.json"))
    with pytest.raises(UsageError, match=r"holds token id 256, but the tokenizer '.*small.json' "
                                         r"has 3 ids: the data was tokenized with another"):
        build_data(_data_args(tmp_path, "--data-path", prefix, "--tokenizer-model",
                              str(tmp_path / "small.json")))


def test_stale_world_size_in_the_shell_is_one_line_not_a_hang(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR")}
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_llama.py"), *FAST_ARGS,
                           "--train-iters", "2", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=REPO, timeout=180,
                          env={**env, "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore"})
    _assert_one_line_error(proc, "WORLD_SIZE=2 is set but RANK is not")
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not (tmp_path / "run").exists()
