"""Pipeline files: a Python file that builds a Hera ``Workflow`` named ``workflow``, or its YAML.

``load_workflow`` returns the Argo ``Workflow`` manifest (Hera's model of it) that ``argo submit`` would
receive; ``with_parameters`` sets workflow parameters the way ``argo submit -p NAME=VALUE`` does.
"""

from __future__ import annotations

import runpy
import traceback
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml
from hera.workflows import Workflow
from hera.workflows.models import Workflow as WorkflowModel
from pydantic import ValidationError

from edl_argo.errors import ConfigError

#: The name a pipeline file gives its workflow.
WORKFLOW_VARIABLE = "workflow"


def load_workflow(path: Path) -> WorkflowModel:
    """The Workflow manifest of a pipeline file (``.py`` defining ``workflow``, or ``.yaml``/``.json``)."""
    if not path.is_file():
        raise ConfigError(f"pipeline file {path} does not exist")
    if path.suffix == ".py":
        return _from_python(path)
    if path.suffix in (".yaml", ".yml", ".json"):
        return _from_manifest(path)
    raise ConfigError(f"pipeline file {path}: expected a Python file (.py) or a manifest (.yaml, .json)")


def parse_parameters(texts: Iterable[str]) -> dict[str, str]:
    """``["epochs=8", ...]`` (the values of ``-p``) -> ``{"epochs": "8", ...}``."""
    values: dict[str, str] = {}
    for text in texts:
        name, sep, value = text.partition("=")
        if not sep or not name:
            raise ConfigError(f"-p {text!r}: expected NAME=VALUE")
        values[name] = value
    return values


def with_parameters(workflow: WorkflowModel, values: Mapping[str, str]) -> WorkflowModel:
    """A copy of ``workflow`` whose workflow parameters have ``values``; each must be declared."""
    workflow = workflow.model_copy(deep=True)
    arguments = workflow.spec.arguments
    declared = {p.name: p for p in (arguments.parameters if arguments and arguments.parameters else [])}
    for name, value in values.items():
        if name not in declared:
            known = ", ".join(declared) or "none"
            raise ConfigError(f"-p {name}: the workflow has no parameter {name!r} (its parameters: {known})")
        declared[name].value = value
    return workflow


def _from_python(path: Path) -> WorkflowModel:
    try:
        namespace = runpy.run_path(str(path), run_name="__edl_argo_pipeline__")
    except Exception as error:
        frames = [
            f
            for f in traceback.extract_tb(error.__traceback__)
            if Path(f.filename).resolve() == path.resolve()
        ]
        where = f"{path} line {frames[-1].lineno}" if frames else str(path)
        raise ConfigError(f"{where}: {type(error).__name__}: {error}") from None
    workflow = namespace.get(WORKFLOW_VARIABLE)
    if not isinstance(workflow, Workflow):
        raise ConfigError(f"{path} defines no `{WORKFLOW_VARIABLE}` (a hera.workflows.Workflow)")
    return workflow.build()


def _from_manifest(path: Path) -> WorkflowModel:
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(document, dict) or document.get("kind") != "Workflow":
        raise ConfigError(f"{path} is not an Argo Workflow manifest (kind: Workflow)")
    try:
        return WorkflowModel.model_validate(document)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"{path}: {field}: {first['msg']}") from None
