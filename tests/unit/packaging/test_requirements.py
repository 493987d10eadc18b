"""setup.py asks for version ranges, so ``pip install -e ".[dev]"`` inside a GPU user's
environment (NGC container, cluster module: a CUDA build of torch with its own triton) keeps
their torch and triton; the exact CPU versions live in the README's set-up command and .ci/run.
"""

import ast
import json
import shutil
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.version import Version

from pretrain_runner import REPO

GPU_STACKS = [("2.6.0", "3.2.0"), ("2.11.0", "3.6.0"), ("2.13.0", "3.9.0")]
"""(torch, triton) pairs users bring: torch 2.6's own triton, the issue's H100 machine, CI."""


def setup_requirements(key: str = "install_requires") -> list[str]:
    """setup.py's ``install_requires``, or with ``key`` an extra (``dev``), as written."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "setup")
    if key == "install_requires":
        return ast.literal_eval(next(k.value for k in call.keywords if k.arg == key))
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    return extras[key]


def test_torch_and_triton_are_ranges_every_gpu_stack_meets():
    reqs = {r.name: r for r in map(Requirement, setup_requirements() + setup_requirements("dev"))}
    for torch_version, triton_version in GPU_STACKS:
        assert reqs["torch"].specifier.contains(torch_version), reqs["torch"]
        assert reqs["triton"].specifier.contains(triton_version), reqs["triton"]
    assert not reqs["torch"].specifier.contains("2.5.1")  # megatron-core 0.16's floor is 2.6
    assert reqs["megatron-core"].specifier.contains("0.16.1")


def test_pip_keeps_the_installed_torch(tmp_path):
    """pip's own resolver, offline, on this environment: installing the package with its dev
    extra would install nothing but the package (a pin torch or triton lack here would fail
    to resolve; a version not installed here cannot be fetched with ``--no-index``)."""
    import torch

    assert Version(torch.__version__.split("+")[0]) >= Version("2.6")
    shutil.copy(REPO / "setup.py", tmp_path)
    (tmp_path / "megatron_ext").mkdir()
    (tmp_path / "megatron_ext" / "__init__.py").touch()
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                    "--no-build-isolation", "--quiet", "--report", str(report),
                    "-e", f"{tmp_path}[dev]"], check=True, capture_output=True, timeout=300)
    installs = json.loads(report.read_text())["install"]
    assert [i["metadata"]["name"] for i in installs] == ["megatron_ext"]
