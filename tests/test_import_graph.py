"""The import graph of ``edl_argo`` keeps its layers (docs/architecture.md).

The contracts are declared once, in pyproject.toml's ``[tool.importlinter]``: the layers of the package top to
bottom (a module imports only from its own package or from layers below; every module or package directly
under ``edl_argo`` must be placed in a layer), and no import cycle between the packages directly under
``edl_argo``. ``import-linter`` checks them with ``grimp``'s graph, which counts function-local imports and
imports under ``TYPE_CHECKING`` too. The second test breaks a copy of the package in each way the contracts
forbid and checks that the contracts notice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run ``lint-imports`` on the ``edl_argo`` found under ``root`` with ``root``'s pyproject.toml."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", LINT, "--config", str(root / "pyproject.toml"), "--no-cache", "--no-logo"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_package_keeps_its_layers_and_has_no_cycles() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout, result.stdout


UPWARD = "\n\ndef _upward() -> None:\n    from edl_argo.master import registry  # noqa: F401\n"
SIDEWAYS = "\n\ndef _sideways() -> None:\n    from edl_argo.pods import base  # noqa: F401\n"


@pytest.mark.parametrize(
    ("module", "added", "reported"),
    [
        # A function-local import of a higher layer (the kind that is easy to miss).
        ("storage/base.py", UPWARD, "edl_argo.storage is not allowed to import edl_argo.master"),
        # One package of a layer importing its independent sibling.
        ("data/__init__.py", SIDEWAYS, "edl_argo.data is not allowed to import edl_argo.pods"),
        # A new package that no layer places.
        ("newpackage/__init__.py", "", "edl_argo.newpackage"),
    ],
    ids=["upward", "sideways", "unplaced"],
)
def test_a_broken_layer_fails_the_check(tmp_path: Path, module: str, added: str, reported: str) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "edl_argo", tmp_path / "edl_argo", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "edl_argo" / module
    path.parent.mkdir(exist_ok=True)
    with path.open("a") as file:
        file.write(added)
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert reported in result.stdout, result.stdout
