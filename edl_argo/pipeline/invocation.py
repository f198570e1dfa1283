"""A planned task made concrete for this machine: inputs bound, variables replaced, paths mapped.

As Argo does for a container step: each input parameter takes the task's argument, else the template's
value or default, and must then be one of the template's ``enum``; input artifacts come from an earlier
task's output (``from``) or are ``raw`` data; tags are replaced in the container (command, args, env) and
in ``activeDeadlineSeconds``. Then what differs on one machine: container paths become host paths (see
:mod:`~edl_argo.pipeline.filesystem`), downward-API fields get this machine's values, Secrets and
ConfigMaps are not read (the runner's own environment holds the settings, ``EDL_S3_ENDPOINT`` and the
``AWS_*`` credentials for S3), and ``edl-argo train`` runs its pods with the local pod backend (the
Kubernetes flags are ignored by that backend).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hera.workflows.models import Artifact, Template

from edl_argo.errors import ConfigError
from edl_argo.pipeline.filesystem import ContainerFilesystem
from edl_argo.pipeline.plan import PlannedTask
from edl_argo.pipeline.variables import substitute, tag_name

#: What ``edl-argo train --backend`` becomes here.
LOCAL_BACKEND = "local"


@dataclass(frozen=True)
class InputArtifact:
    """Where an input artifact goes (``path``) and where it comes from: a saved artifact, or raw data."""

    name: str
    path: Path
    key: str | None = None
    raw: str | None = None


@dataclass(frozen=True)
class Output:
    """An output of the step: an artifact or a parameter file, at ``path``."""

    name: str
    path: Path
    optional: bool = False
    default: str | None = None


@dataclass(frozen=True)
class Invocation:
    """Everything needed to run one step and collect its outputs."""

    argv: tuple[str, ...]
    env: dict[str, str]
    deadline_seconds: float | None
    inputs: tuple[InputArtifact, ...]
    output_artifacts: tuple[Output, ...]
    output_parameters: tuple[Output, ...]


@dataclass(frozen=True)
class Context:
    """What a task's invocation depends on besides its own definition."""

    scope: Mapping[str, str]
    """Values of the tags a task's arguments may use (workflow.*, inputs.*, tasks.*.outputs.parameters.*)."""
    artifact_keys: Mapping[str, str]
    """``tasks.<task>.outputs.artifacts.<name>`` -> where the runner saved that artifact."""
    pod_name: str
    node_name: str
    """``{{node.name}}``: ``<workflow>.<task>`` (an exit hook's task is ``<task>.onExit``)."""
    sandbox: Path
    image_home: Path


def invoke(task: PlannedTask, context: Context) -> Invocation:
    """The invocation of ``task``; ConfigError names what is missing or cannot run here."""
    where = f"task {task.name}"
    template = task.template
    assert template.container is not None  # the plan checked the template (and every path below)
    parameters = _bind_parameters(task, context.scope, where)
    inputs = template.inputs.artifacts or [] if template.inputs else []
    outputs = template.outputs
    output_artifacts = outputs.artifacts or [] if outputs else []
    output_parameters = [p for p in (outputs.parameters or [] if outputs else []) if p.value_from]
    paths = {
        **{f"inputs.artifacts.{a.name}.path": str(a.path) for a in inputs},
        **{f"outputs.artifacts.{a.name}.path": str(a.path) for a in output_artifacts},
        **{f"outputs.parameters.{p.name}.path": str(p.value_from.path) for p in output_parameters},
    }
    filesystem = ContainerFilesystem(context.sandbox, tuple(paths.values()), context.image_home)
    scope = {
        **context.scope,
        **paths,
        "pod.name": context.pod_name,
        "node.name": context.node_name,
        **{f"inputs.parameters.{name}": value for name, value in parameters.items()},
    }
    container = substitute(template.container.model_dump(by_alias=True, exclude_none=True), scope, where)
    argv = _on_this_machine([*container.get("command", []), *container.get("args", [])])
    return Invocation(
        argv=tuple(filesystem.localize(argument) for argument in argv),
        env=_environment(container.get("env", []), context),
        deadline_seconds=_deadline(template, scope, where),
        inputs=tuple(_input_artifact(a, task, context, filesystem, where) for a in inputs),
        output_artifacts=tuple(
            Output(a.name, filesystem.host_path(str(a.path)), optional=bool(a.optional))
            for a in output_artifacts
        ),
        output_parameters=tuple(
            Output(p.name, filesystem.host_path(str(p.value_from.path)), default=p.value_from.default)
            for p in output_parameters
            if p.value_from
        ),
    )


def task_scope(task: PlannedTask, scope: Mapping[str, str]) -> dict[str, str]:
    """``scope`` with the task's input parameters bound (``inputs.parameters.<name>``): what the fields of
    its template may use. ConfigError as :func:`invoke`."""
    parameters = _bind_parameters(task, scope, f"task {task.name}")
    return {**scope, **{f"inputs.parameters.{name}": value for name, value in parameters.items()}}


def _bind_parameters(task: PlannedTask, scope: Mapping[str, str], where: str) -> dict[str, str]:
    given = {p.name: p.value for p in (task.arguments.parameters or [] if task.arguments else [])}
    declared = task.template.inputs.parameters or [] if task.template.inputs else []
    unknown = set(given) - {p.name for p in declared}
    if unknown:
        raise ConfigError(
            f"{where}: {sorted(unknown)[0]!r} is not an input parameter of {task.template.name}"
        )
    values = {}
    for parameter in declared:
        value = next(
            (v for v in (given.get(parameter.name), parameter.value, parameter.default) if v is not None),
            None,
        )
        if value is None:
            raise ConfigError(f"{where}: input parameter {parameter.name} has no value and no default")
        value = substitute(value, scope, f"{where} input parameter {parameter.name}")
        if parameter.enum and value not in parameter.enum:
            raise ConfigError(
                f"{where}: {parameter.name}={value!r} is not one of {', '.join(parameter.enum)}"
            )
        values[parameter.name] = value
    return values


def _input_artifact(
    declared: Artifact, task: PlannedTask, context: Context, filesystem: ContainerFilesystem, where: str
) -> InputArtifact:
    given = {a.name: a for a in (task.arguments.artifacts or [] if task.arguments else [])}
    source = given.get(declared.name, declared)
    path = filesystem.host_path(str(declared.path))
    if source.from_:
        tag = tag_name(source.from_)
        if tag not in context.artifact_keys:
            raise ConfigError(
                f"{where}: artifact {declared.name} comes from {source.from_}, which no earlier task output"
            )
        return InputArtifact(declared.name, path, key=context.artifact_keys[tag])
    if source.raw is not None:
        return InputArtifact(declared.name, path, raw=substitute(source.raw.data, context.scope, where))
    if declared.optional:
        return InputArtifact(declared.name, path)
    raise ConfigError(
        f"{where}: artifact {declared.name} must come from an earlier task (from) or be raw data here"
    )


def _environment(variables: list[dict], context: Context) -> dict[str, str]:
    """This process's environment, then the container's: plain values and downward-API fields."""
    fields = {
        "metadata.name": context.pod_name,
        "metadata.uid": str(uuid.uuid5(uuid.NAMESPACE_URL, context.pod_name)),
        "metadata.namespace": context.scope.get("workflow.namespace", "default"),
        "status.podIP": "127.0.0.1",
    }
    env = dict(os.environ)
    for variable in variables:
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        elif "fieldRef" in variable.get("valueFrom", {}):
            env[variable["name"]] = fields[variable["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _deadline(template: Template, scope: Mapping[str, str], where: str) -> float | None:
    if template.active_deadline_seconds is None:
        return None
    text = substitute(str(template.active_deadline_seconds.root), scope, where)
    try:
        return float(int(text))
    except ValueError:
        raise ConfigError(f"{where}: activeDeadlineSeconds {text!r} is not a number of seconds") from None


#: The commands whose pods run on the ``--backend`` they are given.
_BACKEND_COMMANDS = (["edl-argo", "train"], ["edl-argo", "cleanup"])


def _on_this_machine(argv: list[str]) -> list[str]:
    """``edl-argo train`` (and ``cleanup``) with pods of the local backend (``--backend local``)."""
    if argv[:2] not in _BACKEND_COMMANDS:
        return argv
    local = [f"--backend={LOCAL_BACKEND}" if a.startswith("--backend=") else a for a in argv]
    for i, argument in enumerate(local[:-1]):
        if argument == "--backend":
            local[i + 1] = LOCAL_BACKEND
    return local
