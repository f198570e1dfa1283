"""One kind of edl-argo step (a step template) and the DAG tasks that run it.

A :class:`Step` is defined by two functions: its *function*, the public one a pipeline author calls inside
a Hera ``DAG`` (its ``Input``-annotated arguments are the template's input parameters, see
:mod:`edl_argo.hera.inputs`), and its *builder*, which makes the Hera ``Container`` template from those
inputs (command, artifacts, environment, retry strategy, ...). The same template is

* embedded into a user's workflow by :meth:`Step.task` (the default), or referenced with a
  ``TemplateRef`` to the installed WorkflowTemplate ``Step.workflow_template``; and
* installed in a cluster as part of that WorkflowTemplate (:func:`workflow_template`, rendered from
  ``components/`` into ``templates/``).
"""

from __future__ import annotations

import contextvars
import copy
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Optional

from hera.workflows import Artifact, Container, Parameter, Task, WorkflowTemplate
from hera.workflows.models import Arguments, LifecycleHook, TemplateRef
from hera.workflows.models import Template as TemplateModel

from edl_argo.hera.inputs import StepInputs

#: Labels of every edl-argo WorkflowTemplate.
LABELS = {"app.kubernetes.io/part-of": "edl-argo"}

_TASK_REFERENCE = re.compile(r"\{\{\s*tasks\.([A-Za-z0-9_-]+)\.")


def isolated(build: Callable[..., Any], *args: Any) -> Any:
    """``build(*args)`` outside any Hera context: what it creates is added to no workflow or DAG."""
    return contextvars.Context().run(build, *args)


@dataclass(frozen=True)
class Step:
    """A step template of edl-argo, with the function that declares its inputs and adds it to a DAG."""

    name: str
    """The template's name (``elastic-train``), also the default name of its tasks."""
    workflow_template: str
    """The installed WorkflowTemplate that holds it (``edl-argo-elastic-train``), for ``TemplateRef``."""
    function: Callable[..., Any]
    """The public function; its ``Input``-annotated arguments are the template's input parameters."""
    build: Callable[[StepInputs], Container]
    """Makes the template from the input parameters."""

    @cached_property
    def inputs(self) -> StepInputs:
        return StepInputs.of(self.function)

    @cached_property
    def template(self) -> Container:
        """The template (built once, outside any Hera context)."""
        template: Container = isolated(self.build, self.inputs)
        if template.name != self.name:
            raise ValueError(f"the builder of step {self.name} made a template named {template.name}")
        return template

    def template_model(self) -> TemplateModel:
        """The template as Argo's model, as a workflow that embeds it holds it."""
        built = isolated(
            lambda: WorkflowTemplate(name=self.workflow_template, templates=[self.template]).build()
        )
        return built.spec.templates[0]

    def outputs(self, kind: Literal["parameters", "artifacts"]) -> list[str]:
        """Names of the template's output parameters or artifacts."""
        wanted = Artifact if kind == "artifacts" else Parameter
        return [o.name for o in _as_list(self.template.outputs) if isinstance(o, wanted) and o.name]

    def hook(self, values: Mapping[str, Any], template_ref: bool) -> LifecycleHook:
        """A lifecycle hook (``hooks.exit`` of a task) running this step with ``values`` (the function's
        arguments by name). An embedded template is added to the current workflow."""
        arguments = self.inputs.arguments(values)
        if template_ref:
            reference = TemplateRef(name=self.workflow_template, template=self.name)
            source: dict[str, Any] = {"template_ref": reference}
        else:
            _add_to_workflow(self.template)
            source = {"template": self.name}
        parameters = [argument.as_argument() for argument in arguments]
        return LifecycleHook(arguments=Arguments(parameters=parameters) if parameters else None, **source)

    def task(self, name: str, values: Mapping[str, Any], template_ref: bool) -> StepTask:
        """A task of the current DAG running this step with ``values`` (the function's arguments by name).

        Input parameters come from ``values`` (defaults left out), input artifacts from the ``Artifact``
        values named like them. Tasks whose outputs the arguments use become dependencies (``depends``).
        """
        arguments: list[Parameter | Artifact] = [*self.inputs.arguments(values)]
        for declared in _as_list(self.template.inputs):
            if isinstance(declared, Artifact) and declared.name:
                value = values.get(declared.name.replace("-", "_"))
                if value is not None:
                    arguments.append(value.with_name(declared.name))
                elif not declared.optional:
                    raise ValueError(f"step {name}: the input artifact {declared.name!r} is required")
        upstream = sorted(set(_referenced_tasks(arguments)) - {name})
        source: dict[str, Any] = (
            {"template_ref": TemplateRef(name=self.workflow_template, template=self.name)}
            if template_ref
            else {"template": self.template}
        )
        return StepTask(
            name=name,
            arguments=arguments or None,
            depends=" && ".join(upstream) or None,
            step=self,
            **source,
        )


@dataclass(kw_only=True)
class StepTask(Task):
    """A DAG task running an edl-argo :class:`Step`, embedded or by ``TemplateRef``.

    ``get_artifact`` and ``get_parameter`` return references to this task's outputs in both cases (a
    plain Hera ``Task`` supports them for embedded templates only), and fail early for a name the step
    does not output.
    """

    step: Optional[Step] = None  # noqa: UP045 (Hera's dataclasses keep Optional)

    def get_artifact(self, name: str) -> Artifact:
        return Artifact(name=name, from_=self._output_reference("artifacts", name))

    def get_parameter(self, name: str) -> Parameter:
        return Parameter(name=name, value=self._output_reference("parameters", name))

    def _output_reference(self, kind: Literal["parameters", "artifacts"], name: str) -> str:
        assert self.step is not None
        available = self.step.outputs(kind)
        if name not in available:
            raise KeyError(
                f"step {self.step.name} has no output {kind[:-1]} {name!r}; it has: {', '.join(available)}"
            )
        return f"{{{{tasks.{self.name}.outputs.{kind}.{name}}}}}"


def workflow_template(*steps: Step, description: str, on_exit: Step | None = None) -> WorkflowTemplate:
    """The installable WorkflowTemplate holding ``steps`` (all of one ``workflow_template``).

    Its entrypoint is the first step: ``argo submit --from workflowtemplate/NAME -p ...`` runs that step
    alone (``--entrypoint`` picks another). ``on_exit``, one of ``steps``, is the exit handler of such a
    submit (``spec.onExit``; Argo gives it the workflow's arguments, as it does the entrypoint); workflows
    that reference the steps by ``templateRef`` do not inherit it. ``description`` is shown by the Argo UI.
    """
    if on_exit is not None and on_exit not in steps:
        raise ValueError(f"the exit handler {on_exit.name} must be one of the WorkflowTemplate's steps")
    names = {step.workflow_template for step in steps}
    if len(names) != 1:
        raise ValueError(
            f"steps of different WorkflowTemplates cannot be installed together: {sorted(names)}"
        )
    return isolated(
        lambda: WorkflowTemplate(
            name=names.pop(),
            entrypoint=steps[0].name,
            on_exit=on_exit.name if on_exit is not None else None,
            labels=LABELS,
            annotations={"workflows.argoproj.io/description": " ".join(description.split())},
            templates=[step.template for step in steps],
        )
    )


def _add_to_workflow(template: Container) -> None:
    """Add ``template`` to the workflow being defined (once), as Hera does for a task's own template."""
    from hera.workflows import Workflow
    from hera.workflows._context import _context

    workflow = _context.pieces[0] if _context.pieces else None
    if not isinstance(workflow, Workflow):
        raise ValueError(f"the {template.name} hook must be added inside a Workflow")
    if all(existing.name != template.name for existing in workflow.templates):
        workflow._add_sub(copy.deepcopy(template))


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _referenced_tasks(arguments: Iterable[Parameter | Artifact]) -> Iterable[str]:
    for argument in arguments:
        text = argument.value if isinstance(argument, Parameter) else argument.from_
        if isinstance(text, str):
            yield from _TASK_REFERENCE.findall(text)
