"""The layering contracts of docs/architecture.md (``.importlinter``) hold, and the checker
really catches a violation (a contract that cannot fail proves nothing)."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(config: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--config", str(config), "--no-cache"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    proc = _lint(REPO / ".importlinter", REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_a_forbidden_import_is_caught(tmp_path):
    package = tmp_path / "megatron_ext"
    shutil.copytree(REPO / "megatron_ext", package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (package / "training" / "uses_a_method.py").write_text(
        "from megatron_ext.methods.snip import planner\n")
    proc = subprocess.run([LINT, "--config", str(REPO / ".importlinter"), "--no-cache"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(tmp_path), "PATH": ""})
    assert proc.returncode != 0
    assert ("megatron_ext.training.uses_a_method -> megatron_ext.methods.snip.planner" in
            proc.stdout)


def test_the_plan_value_types_load_no_megatron_core():
    """Issue 24, item 5: ``PrecisionPlan`` / ``SiteFormats`` are values; before the split,
    importing them loaded megatron-core through plan -> layers (7 s)."""
    code = ("import sys; from megatron_ext.precision import PrecisionPlan, SiteFormats; "
            "from megatron_ext.precision.controller import Overlay; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_a_value_type_importing_the_machinery_is_caught(tmp_path):
    package = tmp_path / "megatron_ext"
    shutil.copytree(REPO / "megatron_ext", package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    plan = package / "precision" / "plan.py"
    plan.write_text(plan.read_text() + "\nfrom megatron_ext.precision.layers import apply_plan\n")
    proc = subprocess.run([LINT, "--config", str(REPO / ".importlinter"), "--no-cache"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(tmp_path), "PATH": ""})
    assert proc.returncode != 0
    assert "megatron_ext.precision.plan -> megatron_ext.precision.layers" in proc.stdout
