"""The import graph of ``edl_argo`` keeps its layers (docs/architecture.md).

The contracts are declared once, in pyproject.toml's ``[tool.importlinter]``: the layers of the package top to
bottom (a module imports only from its own package or from layers below; every module or package directly
under ``edl_argo`` must be placed in a layer), and no import cycle between the packages directly under
``edl_argo``. ``import-linter`` checks them with ``grimp``'s graph, which counts function-local imports and
imports under ``TYPE_CHECKING`` too. The second test breaks a copy of the package in each way the contracts
forbid and checks that the contracts notice. docs/architecture.md lists the same layers and cites only modules
that exist.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from importlinter.api import read_configuration

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
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


def test_the_architecture_page_lists_the_layers_of_the_contract() -> None:
    contracts = read_configuration(str(ROOT / "pyproject.toml"))["contracts_options"]
    (contract,) = (c for c in contracts if c["type"] == "layers")
    page = ARCHITECTURE.read_text()
    block = re.search(r"## Layers\n.*?```text\n(.*?)```", page, re.DOTALL)
    assert block, "docs/architecture.md has no ```text block of layers under '## Layers'"
    assert block.group(1).splitlines() == contract["layers"]


def _module_file(parts: list[str]) -> Path | None:
    path = ROOT.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_the_architecture_page_cites_only_modules_that_exist() -> None:
    page = ARCHITECTURE.read_text()
    missing = [path for path in re.findall(r"edl_argo/[\w/]*\w(?:\.py)?", page) if not (ROOT / path).exists()]
    for dotted in set(re.findall(r"edl_argo(?:\.\w+)+", page)):
        parts = dotted.split(".")
        found = next(((n, f) for n in range(len(parts), 0, -1) if (f := _module_file(parts[:n]))), None)
        assert found, dotted
        known, module = found
        rest = parts[known:]
        defines = rf"^(?:class |def )?{rest[0]}\b" if rest else ""
        if len(rest) > 1 or (rest and not re.search(defines, module.read_text(), re.MULTILINE)):
            missing.append(dotted)
    assert not missing, f"docs/architecture.md cites what does not exist: {missing}"
