"""The direction of imports: applications on top, serving and trainer over streams, core at the
bottom (README, "Structure"). The contracts live in pyproject.toml under [tool.importlinter]."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(("module", "source", "edge"), [
    ("online_sao/upward.py", "from serving import app  # noqa: F401\n", "online_sao.upward -> serving.app"),
    ("trainer/upward.py", "from apps import cli  # noqa: F401\n", "trainer.upward -> apps.cli"),
    ("streams/upward.py", "from trainer import learner  # noqa: F401\n", "streams.upward -> trainer.learner"),
], ids=["core-imports-serving", "trainer-imports-apps", "streams-imports-trainer"])
def test_an_upward_import_breaks_the_contract(tmp_path, module, source, edge):
    root = copy_tree(tmp_path)
    (root / module).write_text(source)
    result = lint_imports(root)
    assert result.returncode != 0
    assert edge in result.stdout
