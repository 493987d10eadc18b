"""Every launch example's arguments parse and pass ``--dry-run``.

Each example keeps its pretrain flags in one bash array and honours ``DRY_RUN=1``: then it
runs ``python <entry point> "${ARGS[@]}" --dry-run`` instead of srun / torchrun. The test runs
each script that way with a stand-in ``python`` first on PATH that only records the command
(bash only, no imports), then runs every recorded command's entry point in this process
(``runpy``, exactly as ``python pretrain_llama.py ...`` would) and checks it exits 0 with the
dry-run report. One example is also run end to end as a user would.
"""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain_runner import REPO
import megatron_ext.precision.extension  # noqa: F401  (import cost at collection, not in a test)
import megatron_ext.training.pretrain  # noqa: F401

EXAMPLES = sorted(str(p.relative_to(REPO)) for p in
                  [*REPO.glob("examples/*.sh"), *REPO.glob("examples/slurm/*.sbatch")])
SRUN_EXAMPLES = ["examples/slurm/llama3_70b_snip.sbatch", "examples/slurm/llama3_8b_fp8.sbatch"]
RECORDER = "#!/bin/sh\nprintf '%s\\0' \"$@\" > \"$EXAMPLE_CMD_DIR/$(date +%s%N)-$$\"\n"


def _recorded_commands(example: str, tmp_path: Path) -> list[list[str]]:
    """Run ``example`` with DRY_RUN=1 and a recording ``python``; the commands, in order."""
    bin_dir, cmd_dir = tmp_path / "bin", tmp_path / "cmds"
    bin_dir.mkdir(), cmd_dir.mkdir()
    (bin_dir / "python").write_text(RECORDER)
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "DRY_RUN": "1", "EXAMPLE_CMD_DIR": str(cmd_dir),
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for name in ("DATA", "TOKENIZER", "SLURM_JOB_ID", "SLURM_NNODES", "CKPT", "SEQ"):
        env.pop(name, None)
    proc = subprocess.run(["bash", example], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    files = sorted(cmd_dir.iterdir())
    return [f.read_bytes().decode().split("\0")[:-1] for f in files]


def _run_entry_point(argv: list[str], monkeypatch) -> int:
    """``python <argv>`` in this process (the entry point's ``__main__`` block)."""
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / argv[0]), run_name="__main__")
    return exit_info.value.code


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_passes_dry_run(example, tmp_path, monkeypatch, capsys):
    commands = _recorded_commands(example, tmp_path)
    assert commands, f"{example} ran no pretrain command under DRY_RUN=1"
    for argv in commands:
        assert argv[0] in ("pretrain_llama.py", "pretrain_gpt.py") and "--dry-run" in argv
        code = _run_entry_point(argv, monkeypatch)
        out, err = capsys.readouterr()
        assert code == 0, err[-2000:]
        assert out.startswith("dry run:") and "parameters:" in out
        assert ("SNIP ILP" in out) == _runs_snip(argv), "SNIP reports exactly when it runs"


def _runs_snip(argv: list[str]) -> bool:
    """Whether ``argv``'s ``--precision`` is one of the policies SNIP brings to a run."""
    from megatron_ext.defaults import default_extensions
    if "--precision" not in argv:
        return False
    snip = next(e for e in default_extensions() if e.name == "snip")
    return argv[argv.index("--precision") + 1] in {p.name for p in snip.policies}


@pytest.mark.parametrize("example", SRUN_EXAMPLES)
def test_gpu_examples_launch_with_srun(example):
    text = (REPO / example).read_text()
    assert 'exec srun python pretrain_llama.py "${ARGS[@]}"' in text
    assert "#SBATCH --ntasks-per-node=8" in text and "#SBATCH --gpus-per-node=8" in text


def test_llama3_70b_snip_layout_is_64_gpus(tmp_path):
    argv = _recorded_commands("examples/slurm/llama3_70b_snip.sbatch", tmp_path)[0]
    flags = dict(zip(argv[1::2], argv[2::2]))
    assert (flags["--tensor-model-parallel-size"], flags["--pipeline-model-parallel-size"],
            flags["--data-parallel-size"]) == ("4", "8", "2")
    assert argv[argv.index("--precision") + 1] == "snip"
    assert argv[argv.index("--snip-budget") + 1] == "0.5"
    text = (REPO / "examples/slurm/llama3_70b_snip.sbatch").read_text()
    assert "#SBATCH --nodes=8" in text


def test_dry_run_end_to_end_like_a_user(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "examples/slurm/llama3_8b_fp8.sbatch"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "16 GPUs = TP 8 x PP 1 x DP 2" in proc.stdout
    assert "parameters: 8,030,261,248" in proc.stdout  # Llama-3-8B
    assert "plan uniform:fp8" in proc.stdout


IO_FLAGS = {"--data-path", "--tokenizer-model", "--save", "--save-interval", "--load",
            "--tensorboard-dir", "--run-dir", "--dry-run"}
"""Where a job reads and writes: the dry run reads none of them."""


@pytest.mark.parametrize("doc, pattern", [("README.md", "the same by hand"),
                                          ("docs/quickstart.md", "llama3-70b.*--dry-run")])
def test_70b_dry_run_by_hand_has_the_sbatch_flags(doc, pattern, tmp_path):
    """The documented hand-typed dry run gives the sbatch dry run's report: the same flags,
    except where data and checkpoints live (the sbatch's report is checked above)."""
    from doc_commands import find_command, flag_values

    by_hand = find_command(doc, pattern).argv
    sbatch = _recorded_commands("examples/slurm/llama3_70b_snip.sbatch", tmp_path)[0]
    assert by_hand[:2] == ["python", sbatch[0]] and "--dry-run" in by_hand
    ours, theirs = flag_values(by_hand[2:]), flag_values(sbatch[1:])
    assert ({f: v for f, v in ours.items() if f not in IO_FLAGS} ==
            {f: v for f, v in theirs.items() if f not in IO_FLAGS})
