"""The commands of the README and the quick start parse as written: every flag exists and
takes the value shown (pretrain's own checks and every method's ``validate`` included), for
the entry points, the tools and the benchmarks. Placeholders (``runs/<ts>``, ``tokenizer.json``,
``my.jsonl``) stay as they are: nothing is read or run. The SLURM scripts and the hand-typed
70B dry run are checked by tests/e2e/test_examples.py."""

import argparse
import runpy
import sys

import pytest

from doc_commands import doc_commands
from pretrain_runner import REPO

DOCS = ["README.md", "docs/quickstart.md"]


class _Parsed(Exception):
    """Raised after a tool's parser accepted its arguments: stop before any work."""


def _script(argv: list[str]) -> tuple[int, int] | None:
    """(index of the Python script in ``argv``, processes it runs as); None for commands
    that start no script of ours (pip, pytest, bash, sbatch, docker)."""
    for i, token in enumerate(argv):
        if token.endswith(".py") and (REPO / token).is_file():
            launcher = argv[:i]
            nproc = next((int(launcher[j + 1]) for j, t in enumerate(launcher)
                          if t in ("--nproc-per-node", "-n")), 1)
            return i, nproc
    return None


def _commands() -> list:
    return [pytest.param(c, id=c.where) for doc in DOCS for c in doc_commands(doc)
            if _script(c.argv) is not None]


def _parse_pretrain(family: str, argv: list[str], files) -> None:
    from megatron_ext.defaults import default_extensions
    from megatron_ext.training.pretrain import parse_and_validate

    # the files pretrain reads while parsing: the plan, the checkpoint's metadata
    argv = [files["plan.json"] if a == "plan.json" else
            a.replace("runs/<ts>", files["runs/<ts>"]) for a in argv]
    parse_and_validate(family, argv, default_extensions())


def _parse_tool(script: str, argv: list[str], monkeypatch) -> None:
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed()

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(_Parsed):
        runpy.run_path(str(REPO / script), run_name="__main__")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Stand-ins for the placeholders pretrain reads while parsing: a real plan for
    ``--precision-plan plan.json`` (the tiny model's 4 layers), a run with a checkpoint."""
    from megatron_ext.precision.plan import save_plan
    from megatron_ext.precision.policies import uniform_plan

    root = tmp_path_factory.mktemp("docs")
    save_plan(uniform_plan("fp8", 4), str(root / "plan.json"))
    (root / "run" / "checkpoints").mkdir(parents=True)
    (root / "run" / "checkpoints" / "metadata.json").write_text("{}")
    return {"plan.json": str(root / "plan.json"), "runs/<ts>": str(root / "run")}


@pytest.mark.parametrize("command", _commands())
def test_documented_command_parses(command, files, monkeypatch):
    argv = command.argv
    index, nproc = _script(argv)
    script, rest = argv[index], [a for a in argv[index + 1:] if a != "--help"]
    if script.startswith("pretrain_"):
        monkeypatch.setenv("RANK", "0")  # as the launcher (torchrun, mpiexec) starts it
        monkeypatch.setenv("WORLD_SIZE", str(nproc))
        _parse_pretrain(script.removeprefix("pretrain_").removesuffix(".py"), rest, files)
    else:
        _parse_tool(script, rest, monkeypatch)
