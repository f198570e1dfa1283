"""``edl-argo pipeline run``: a workflow's DAG run on this machine, with no cluster.

The runner does what Argo's controller and executor do for each task, in dependency order, one task at a
time: resolve the task's arguments (workflow parameters, earlier tasks' output parameters and artifacts),
put its input artifacts in place, run its ``edl-argo`` command as a local process (see
:mod:`~edl_argo.pipeline.invocation` for what differs from a cluster), then read its output parameters
and save its output artifacts to the artifact repository (a folder, or ``s3://...``). A task that fails
stops the tasks that depend on it, and with the DAG's ``failFast`` (Argo's default) every task not
started yet; they are reported *Omitted*. Every run has its own folder under ``workdir``::

    <workdir>/<workflow>/workflow.yaml         the manifest that was run (parameters applied)
    <workdir>/<workflow>/steps/<task>/         the task's sandbox (its container paths, its progress file)
    <workdir>/artifacts/<workflow>/<task>/...  saved artifacts (unless another repository is given)
"""

from __future__ import annotations

import enum
import secrets
import string
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hera.workflows.models import Template
from hera.workflows.models import Workflow as WorkflowModel
from tqdm import tqdm

from edl_argo.errors import EdlError, JobFailedError
from edl_argo.hera import STEPS
from edl_argo.log import get_logger
from edl_argo.pipeline.artifacts import ArtifactStore
from edl_argo.pipeline.filesystem import source_root
from edl_argo.pipeline.invocation import Context, Invocation, invoke
from edl_argo.pipeline.plan import Plan, PlannedTask, plan
from edl_argo.pipeline.process import ProcessResult, run_process

log = get_logger(__name__)

#: Namespace of a workflow that names none (``{{workflow.namespace}}``).
DEFAULT_NAMESPACE = "default"


class Phase(str, enum.Enum):
    """How a task ended (Argo's node phases)."""

    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    OMITTED = "Omitted"


@dataclass
class StepResult:
    """One task's outcome: its phase, why (for a failure or an omission), outputs and duration."""

    name: str
    template: str
    phase: Phase
    message: str = ""
    seconds: float = 0.0
    parameters: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)
    """Artifact name -> URL of the saved artifact."""


@dataclass
class RunResult:
    """A whole run: the workflow's name, where its files are, and every task's result in run order."""

    workflow: str
    folder: Path
    steps: list[StepResult]
    seconds: float

    @property
    def failed(self) -> StepResult | None:
        """The task that failed, if one did."""
        return next((s for s in self.steps if s.phase is Phase.FAILED), None)

    def step(self, name: str) -> StepResult:
        return next(s for s in self.steps if s.name == name)


def template_references() -> dict[tuple[str, str], Template]:
    """``(WorkflowTemplate, template)`` -> template, for every edl-argo step (what ``templateRef`` names)."""
    return {(step.workflow_template, step.name): step.template_model() for step in STEPS}


class LocalRunner:
    """Runs one workflow's entrypoint DAG here; :meth:`run` returns what happened."""

    def __init__(
        self,
        workflow: WorkflowModel,
        workdir: Path,
        artifacts_url: str | None = None,
        sink: Callable[[str], None] | None = None,
    ) -> None:
        self.workflow = workflow
        # Refuse what cannot run here before anything runs.
        self.plan: Plan = plan(workflow, template_references())
        meta = workflow.metadata
        self.name = meta.name or (meta.generate_name or "workflow-") + _suffix()
        self.folder = workdir / self.name
        self.store = ArtifactStore(artifacts_url or str(workdir / "artifacts"))
        self.sink = sink or (lambda line: tqdm.write(line, file=sys.stderr))
        self.image_home = source_root()
        self.scope = self._global_scope(meta.namespace or DEFAULT_NAMESPACE)
        self.artifact_keys: dict[str, str] = {}

    def run(self) -> RunResult:
        """Run every task (or report it Omitted); never raises for a task that fails."""
        started = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "workflow.yaml").write_text(_to_yaml(self.workflow, self.name))
        log.info("pipeline_started", workflow=self.name, tasks=len(self.plan.tasks), folder=str(self.folder))
        results: dict[str, StepResult] = {}
        for task in self.plan.tasks:
            results[task.name] = self._omission(task, results) or self._run_task(task)
            if task.exit_hook is not None and results[task.name].phase is not Phase.OMITTED:
                results[task.exit_hook.name] = self._run_task(task.exit_hook)
        result = RunResult(self.name, self.folder, list(results.values()), time.monotonic() - started)
        failed = result.failed
        if failed is None:
            log.info("pipeline_succeeded", workflow=self.name, seconds=round(result.seconds, 1))
        else:
            log.error("pipeline_failed", workflow=self.name, step=failed.name, error=failed.message)
        return result

    def _omission(self, task: PlannedTask, results: dict[str, StepResult]) -> StepResult | None:
        """The result of a task that must not run because of a failure before it, else None."""
        blocked = next((d for d in task.dependencies if results[d].phase is not Phase.SUCCEEDED), None)
        failed = next((r.name for r in results.values() if r.phase is Phase.FAILED), None)
        if blocked is not None:
            message = f"not run: it depends on {blocked}, which did not succeed"
        elif failed is not None and self.plan.fail_fast:
            message = f"not run: {failed} failed and the DAG fails fast"
        else:
            return None
        log.warning("step_omitted", step=task.name, reason=message)
        return StepResult(task.name, task.template.name or "", Phase.OMITTED, message)

    def _run_task(self, task: PlannedTask) -> StepResult:
        started = time.monotonic()
        result = StepResult(task.name, task.template.name or "", Phase.FAILED)
        try:
            context = self._context(task)
            context.sandbox.mkdir(parents=True, exist_ok=True)
            invocation = invoke(task, context)
            self._put_inputs(invocation)
            log.info(
                "step_started",
                step=task.name,
                template=result.template,
                command=" ".join(invocation.argv[:3]),
            )
            ended = run_process(
                invocation.argv,
                invocation.env,
                task.name,
                context.sandbox / "progress",
                invocation.deadline_seconds,
                self.sink,
            )
            if ended.exit_code == 0:
                self._collect_outputs(task, invocation, result)
                result.phase = Phase.SUCCEEDED
            else:
                result.message = _failure(ended, invocation)
        except EdlError as error:
            result.message = str(error)
        result.seconds = time.monotonic() - started
        if result.phase is Phase.SUCCEEDED:
            log.info("step_succeeded", step=task.name, seconds=round(result.seconds, 1))
        else:
            log.error("step_failed", step=task.name, error=result.message)
        return result

    def _context(self, task: PlannedTask) -> Context:
        return Context(
            scope=self.scope,
            artifact_keys=self.artifact_keys,
            pod_name=f"{self.name}-{task.name}".replace(".", "-"),
            node_name=f"{self.name}.{task.name}",
            sandbox=self.folder / "steps" / task.name,
            image_home=self.image_home,
        )

    def _put_inputs(self, invocation: Invocation) -> None:
        for artifact in invocation.inputs:
            if artifact.key is not None:
                self.store.load(artifact.key, artifact.path)
            elif artifact.raw is not None:
                artifact.path.parent.mkdir(parents=True, exist_ok=True)
                artifact.path.write_text(artifact.raw)

    def _collect_outputs(self, task: PlannedTask, invocation: Invocation, result: StepResult) -> None:
        for parameter in invocation.output_parameters:
            if parameter.path.is_file():
                value = parameter.path.read_text().strip()
            elif parameter.default is not None:
                value = parameter.default
            else:
                raise JobFailedError(f"output parameter {parameter.name}: the step wrote no {parameter.path}")
            result.parameters[parameter.name] = value
            self.scope[f"tasks.{task.name}.outputs.parameters.{parameter.name}"] = value
        for artifact in invocation.output_artifacts:
            if not artifact.path.exists():
                if artifact.optional:
                    continue
                raise JobFailedError(
                    f"output artifact {artifact.name}: the step wrote nothing at {artifact.path}"
                )
            key = f"{self.name}/{task.name}/{artifact.name}"
            result.artifacts[artifact.name] = self.store.save(key, artifact.path)
            self.artifact_keys[f"tasks.{task.name}.outputs.artifacts.{artifact.name}"] = key

    def _global_scope(self, namespace: str) -> dict[str, str]:
        arguments = self.workflow.spec.arguments
        parameters = {p.name: p.value or "" for p in (arguments.parameters or [] if arguments else [])}
        scope = {
            "workflow.name": self.name,
            "workflow.namespace": namespace,
            "workflow.uid": str(uuid.uuid4()),
            **{f"workflow.parameters.{name}": value for name, value in parameters.items()},
        }
        entry_inputs = self.plan.entrypoint.inputs
        for parameter in (
            entry_inputs.parameters or [] if entry_inputs else []
        ):  # the entrypoint gets the arguments
            value = parameters.get(parameter.name, parameter.value or parameter.default)
            if value is not None:
                scope[f"inputs.parameters.{parameter.name}"] = value
        return scope


def _failure(ended: ProcessResult, invocation: Invocation) -> str:
    """Why a step's process failed, on one line: its own error line if it printed one."""
    lines = [line.strip() for line in ended.last_lines if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    if ended.timed_out:
        return f"stopped after activeDeadlineSeconds={invocation.deadline_seconds:.0f}"
    detail = errors[-1] if errors else (lines[-1] if lines else "no output")
    return f"exit code {ended.exit_code}: {detail}"


def _suffix() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))


def _to_yaml(workflow: WorkflowModel, name: str) -> str:
    import yaml

    manifest = workflow.model_dump(by_alias=True, exclude_none=True, mode="json")
    manifest["metadata"] = {**manifest.get("metadata", {}), "name": name}
    manifest["metadata"].pop("generateName", None)
    return yaml.safe_dump(manifest, sort_keys=False)
