"""Every tool checks its outputs before any work: an output under a regular file is one
``error:`` line naming the flag, exit status 2, and nothing written (not even a folder)."""

import subprocess
import sys

import pytest

from pretrain_runner import REPO

# tool, its arguments (BAD = a path under a regular file, IN = an existing input file)
CASES = {
    "preprocess_data": ["preprocess_data.py", "--input", "IN", "--output-prefix", "BAD/d"],
    "hf-to-megatron": ["convert_checkpoint.py", "hf-to-megatron", "--hf-dir", "IN",
                       "--out", "BAD/ckpt"],
    "megatron-to-hf": ["convert_checkpoint.py", "megatron-to-hf", "--load", "IN",
                       "--out", "BAD/hf"],
    "snip_analyze": ["snip_analyze.py", "--problem", "IN", "--budget", "0.5",
                     "--out", "BAD/plan.json"],
    "tune_precision dir": ["tune_precision.py", "--stats", "IN", "--out", "BAD/tuned"],
    "tune_precision explain": ["tune_precision.py", "--stats", "IN", "--out", "OK/tuned",
                               "--explain-json", "BAD/why.json"],
    "plot_precision": ["plot_precision.py", "plan", "IN", "--out", "BAD/plan.png"],
    "make_default_corpus": ["make_default_corpus.py", "--out", "BAD/corpus"],
    "gaussws_hint": ["gaussws_hint.py", "IN", "--out", "BAD/plan.json"],
}
FLAG = {"preprocess_data": "--output-prefix", "tune_precision explain": "--explain-json"}


@pytest.mark.parametrize("case", list(CASES))
def test_output_under_a_file_is_refused_before_work(case, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    source = tmp_path / "input.jsonl"
    source.write_text('{"text": "hello"}\n')
    subs = {"BAD": str(blocker), "IN": str(source), "OK": str(tmp_path / "ok")}
    tool, *args = CASES[case]
    args = [subs.get(a.split("/")[0], a.split("/")[0]) + a[len(a.split("/")[0]):]
            for a in args]
    proc = subprocess.run([sys.executable, str(REPO / "tools" / tool), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: {FLAG.get(case, '--out')}: cannot write '{blocker}")
    assert lines[0].endswith("is a file, not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker", "input.jsonl"]
