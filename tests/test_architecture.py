"""The direction of imports: applications on top, serving and trainer over streams, core at the
bottom (README, "Structure"). The contracts live in pyproject.toml under [tool.importlinter]."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("online_sao", "streams", "serving", "trainer", "apps")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter over the packages under ``root`` with the project's contracts."""
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()", "--config", str(root / "pyproject.toml"), "--no-cache"],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def copy_tree(dest: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_an_upward_import_from_core_breaks_the_contract(tmp_path):
    root = copy_tree(tmp_path)
    (root / "online_sao" / "upward.py").write_text("from serving import app  # noqa: F401\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "online_sao.upward -> serving.app" in result.stdout


def test_a_component_importing_an_application_breaks_the_contract(tmp_path):
    root = copy_tree(tmp_path)
    (root / "trainer" / "upward.py").write_text("from apps import cli  # noqa: F401\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert "trainer.upward -> apps.cli" in result.stdout
