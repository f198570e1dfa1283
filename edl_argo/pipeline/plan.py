"""What the local runner will run: the entrypoint's tasks in dependency order, each with its template.

:func:`plan` checks the whole workflow before anything runs and refuses, naming the task and the feature,
what it cannot run the way Argo would: templates other than containers whose command is ``edl-argo``
(scripts, resources, arbitrary images, ...), nested DAGs and steps, conditional or looping tasks,
workflow-level exit handlers, hooks other than a task's exit hook, volumes other than optional Secret
volumes (left empty, as a missing Secret's are) and sidecars. The entrypoint is
a DAG of container tasks, or a single container. Templates referenced with ``templateRef`` resolve to the
edl-argo WorkflowTemplates of :data:`edl_argo.hera.STEPS`, which the runner knows without a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hera.workflows.models import Arguments, DAGTask, Template, TemplateRef
from hera.workflows.models import Workflow as WorkflowModel

from edl_argo.errors import ConfigError

#: The program every step must run.
PROGRAM = "edl-argo"
#: Environment fields (downward API) the runner can fill in.
FIELD_PATHS = ("metadata.name", "metadata.uid", "metadata.namespace", "status.podIP")

_UNSUPPORTED_TASK_FIELDS = (
    "when",
    "with_items",
    "with_param",
    "with_sequence",
    "continue_on",
    "on_exit",
)
_UNSUPPORTED_TEMPLATE_FIELDS = ("sidecars", "init_containers", "daemon")
_OTHER_KINDS = ("steps", "script", "resource", "suspend", "http", "data", "container_set", "plugin", "dag")
_DEPENDENCY = re.compile(r"^\(?\s*([A-Za-z0-9_-]+)(\.Succeeded)?\s*\)?$")


@dataclass(frozen=True)
class PlannedTask:
    """One container step to run: its task name, template, arguments and the tasks it waits for."""

    name: str
    template: Template
    arguments: Arguments | None
    dependencies: tuple[str, ...]
    exit_hook: PlannedTask | None = None
    """The task's ``hooks.exit``, run once the task has ended, whatever its outcome (``<task>.onExit``)."""


@dataclass(frozen=True)
class Plan:
    """The entrypoint's tasks in an order that runs every task after its dependencies."""

    entrypoint: Template
    tasks: tuple[PlannedTask, ...]

    @property
    def fail_fast(self) -> bool:
        """Whether one failed task stops every task not started yet (Argo's default for a DAG)."""
        return self.entrypoint.dag is None or self.entrypoint.dag.fail_fast is not False


def plan(workflow: WorkflowModel, references: dict[tuple[str, str], Template]) -> Plan:
    """The tasks of ``workflow``'s entrypoint; ``references`` resolves ``templateRef`` (name, template).

    Raises:
        ConfigError: something the local runner cannot run, named.
    """
    spec = workflow.spec
    for field, what in (
        ("workflow_template_ref", "workflowTemplateRef"),
        ("on_exit", "onExit"),
        ("hooks", "hooks"),
    ):
        if getattr(spec, field):
            raise ConfigError(f"the workflow uses spec.{what}, which the local runner cannot run")
    templates = {t.name: t for t in spec.templates or []}
    entrypoint = templates.get(spec.entrypoint or "")
    if entrypoint is None:
        raise ConfigError(f"the workflow's entrypoint {spec.entrypoint!r} is not one of its templates")
    if entrypoint.dag is None:
        _check_container(entrypoint, f"template {entrypoint.name}")
        return Plan(entrypoint, (PlannedTask(entrypoint.name or "main", entrypoint, None, ()),))
    tasks = [_planned(task, templates, references) for task in entrypoint.dag.tasks]
    return Plan(entrypoint, _in_dependency_order(tasks))


def _planned(
    task: DAGTask, templates: dict[str | None, Template], references: dict[tuple[str, str], Template]
) -> PlannedTask:
    where = f"task {task.name}"
    for field in _UNSUPPORTED_TASK_FIELDS:
        if getattr(task, field) is not None:
            raise ConfigError(f"{where} uses {field}, which the local runner cannot run")
    template = _resolved(task.template_ref, task.template or task.inline, templates, references, where)
    hooks = dict(task.hooks or {})
    exit_hook = hooks.pop("exit", None)
    if hooks or (exit_hook is not None and exit_hook.expression):
        raise ConfigError(f"{where} uses a hook other than an exit hook, which the local runner cannot run")
    hook = None
    if exit_hook is not None:
        hook_where = f"{where} exit hook"
        source = exit_hook.template_ref, exit_hook.template
        hook_template = _resolved(*source, templates, references, hook_where)
        hook = PlannedTask(f"{task.name}.onExit", hook_template, exit_hook.arguments, ())
    return PlannedTask(task.name, template, task.arguments, _dependencies(task, where), hook)


def _resolved(
    ref: TemplateRef | None,
    name: object,
    templates: dict[str | None, Template],
    references: dict[tuple[str, str], Template],
    where: str,
) -> Template:
    """The container template a task (or hook) runs, by ``templateRef`` or by name; checked."""
    if ref is not None:
        template = _referenced(ref, references, where)
    elif isinstance(name, str) and name in templates:
        template = templates[name]
    else:
        raise ConfigError(f"{where}: template {name!r} is not one of the workflow's")
    _check_container(template, f"{where} (template {template.name})")
    return template


def _referenced(ref: TemplateRef, references: dict[tuple[str, str], Template], where: str) -> Template:
    template = references.get((ref.name or "", ref.template or ""))
    if template is None or ref.cluster_scope:
        known = ", ".join(f"{name}/{tmpl}" for name, tmpl in sorted(references))
        raise ConfigError(
            f"{where}: templateRef {ref.name}/{ref.template} is not an edl-argo WorkflowTemplate, so it"
            f" cannot run locally (known: {known})"
        )
    return template


def _check_container(template: Template, where: str) -> None:
    kind = next((k for k in _OTHER_KINDS if getattr(template, k) is not None), None)
    if kind is not None or template.container is None:
        raise ConfigError(
            f"{where} is a {kind or 'template without a container'}; the local runner runs containers"
        )
    container = template.container
    argv = [*(container.command or []), *(container.args or [])]
    if not argv or argv[0] != PROGRAM:
        raise ConfigError(
            f"{where} runs {argv[0] if argv else 'its image entrypoint'!r} in image {container.image};"
            f" the local runner only runs `{PROGRAM}` commands"
        )
    for field in _UNSUPPORTED_TEMPLATE_FIELDS:
        if getattr(template, field):
            raise ConfigError(f"{where} uses {field}, which the local runner cannot run")
    _check_volumes(template, where)
    artifacts = [*(template.inputs.artifacts or [] if template.inputs else [])]
    artifacts += template.outputs.artifacts or [] if template.outputs else []
    for artifact in artifacts:
        if not artifact.path:
            raise ConfigError(f"{where}: artifact {artifact.name} has no path in the container")
    outputs = template.outputs
    for parameter in outputs.parameters or [] if outputs else []:
        if parameter.value_from is None or not parameter.value_from.path:
            raise ConfigError(
                f"{where}: output parameter {parameter.name} is not read from a file (valueFrom.path)"
            )
    for variable in container.env or []:
        source = variable.value_from
        field_ref = source.field_ref if source else None
        if field_ref is not None and field_ref.field_path not in FIELD_PATHS:
            raise ConfigError(
                f"{where}: env {variable.name} comes from {field_ref.field_path}, unknown locally"
            )


def _check_volumes(template: Template, where: str) -> None:
    """Only optional Secret volumes (the elastic-train master's): there are no Secrets locally, and an
    optional Secret volume whose Secret does not exist is empty on Kubernetes too, so the runner mounts
    nothing. Any other volume is refused."""
    optional_secrets = set()
    for volume in template.volumes or []:
        if volume.secret is None or not volume.secret.optional:
            raise ConfigError(
                f"{where} uses volume {volume.name}, which the local runner cannot provide (only optional"
                " Secret volumes, left empty)"
            )
        optional_secrets.add(volume.name)
    assert template.container is not None
    for mount in template.container.volume_mounts or []:
        if mount.name not in optional_secrets:
            raise ConfigError(f"{where} mounts {mount.name}, which the local runner cannot provide")


def _dependencies(task: DAGTask, where: str) -> tuple[str, ...]:
    names = list(task.dependencies or [])
    for part in (task.depends or "").split("&&") if task.depends else []:
        match = _DEPENDENCY.match(part.strip())
        if match is None:
            raise ConfigError(
                f"{where}: depends {task.depends!r} is more than 'a && b.Succeeded', which the local runner"
                " cannot run"
            )
        names.append(match.group(1))
    return tuple(dict.fromkeys(names))


def _in_dependency_order(tasks: list[PlannedTask]) -> tuple[PlannedTask, ...]:
    by_name = {task.name: task for task in tasks}
    for task in tasks:
        for dependency in task.dependencies:
            if dependency not in by_name:
                raise ConfigError(
                    f"task {task.name} depends on {dependency!r}, which is not a task of the DAG"
                )
    ordered: list[PlannedTask] = []
    done: set[str] = set()
    while len(ordered) < len(tasks):
        ready = [t for t in tasks if t.name not in done and set(t.dependencies) <= done]
        if not ready:
            cycle = ", ".join(t.name for t in tasks if t.name not in done)
            raise ConfigError(f"tasks {cycle} depend on each other in a cycle")
        ordered.append(ready[0])
        done.add(ready[0].name)
    return tuple(ordered)
