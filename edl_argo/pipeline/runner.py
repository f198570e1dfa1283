"""``edl-argo pipeline run``: a workflow's DAG run on this machine, with no cluster, as Argo runs it.

Every task whose dependencies have succeeded starts at once (at most ``parallelism`` at a time, Argo's
``spec.parallelism`` or ``--parallelism``). For each task the runner does what Argo's controller and
executor do: resolve its arguments (workflow parameters, earlier tasks' output parameters and artifacts),
put its input artifacts in place, run its ``edl-argo`` command as a local process (see
:mod:`~edl_argo.pipeline.invocation` for what differs from a cluster), then read its output parameters and
save its output artifacts to the artifact repository (a folder, or ``s3://...``).

* **Retries** follow the template's ``retryStrategy``: ``limit``, ``retryPolicy`` (a process that could not
  start is an ``Error``, a non-zero exit a failure), ``expression`` (:mod:`~edl_argo.pipeline.expressions`,
  with ``lastRetry.*``) and ``backoff`` (``duration``, ``factor``, ``maxDuration``, which also bounds each
  retry's deadline to what is left of it).
* **Deadlines** (``activeDeadlineSeconds``) stop the step's process with SIGTERM, as the kubelet does, and
  fail the attempt with Argo's message (``... longer than the specified deadline``).
* **Exit hooks** (a task's ``hooks.exit``) run once the task has ended for good, whatever its outcome; they
  are reported as ``<task>.onExit``.
* **Warm steps.** A run with steps that run ``train``, ``evaluate``, ``predict`` or ``sql`` starts a warm
  server as it starts (:class:`~edl_argo.pods.warm.ScopedServer`; not if one serves already, nor with
  ``EDL_WARM=0``): those steps, and a training step's pods, are forked from it instead of each importing
  TensorFlow. Such a step waits until it is ready (it boots while the first steps run); the run retires
  it as it ends.
* A task that fails stops the tasks that depend on it, and with the DAG's ``failFast`` (Argo's default)
  every task not started yet; tasks already running go on. Those not run are reported *Omitted*.

Every run has its own folder under ``workdir``::

    <workdir>/<workflow>/workflow.yaml         the manifest that was run (parameters applied)
    <workdir>/<workflow>/steps/<task>/         the task's sandbox (its container paths, its progress file)
    <workdir>/artifacts/<workflow>/<task>/...  saved artifacts (unless another repository is given)
"""

from __future__ import annotations

import contextlib
import enum
import re
import secrets
import string
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from hera.workflows.models import RetryStrategy, Template
from hera.workflows.models import Workflow as WorkflowModel
from tqdm import tqdm

from edl_argo.errors import ConfigError, EdlError, JobFailedError
from edl_argo.hera import STEPS
from edl_argo.log import get_logger
from edl_argo.pipeline.artifacts import ArtifactStore
from edl_argo.pipeline.expressions import evaluate
from edl_argo.pipeline.filesystem import source_root
from edl_argo.pipeline.invocation import Context, Invocation, invoke, task_scope
from edl_argo.pipeline.plan import Plan, PlannedTask, plan
from edl_argo.pipeline.process import ProcessResult, run_process
from edl_argo.pipeline.variables import substitute
from edl_argo.pods.warm import ScopedServer, runs_warm

log = get_logger(__name__)

#: What Argo says of a pod stopped at its deadline (retry expressions look for "deadline").
DEADLINE_MESSAGE = "Pod was active on the node longer than the specified deadline"
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
    attempts: int = 1
    """How many times it ran (its retries plus one)."""
    started: float = 0.0
    """When its first attempt started (``time.monotonic()``)."""
    status: str = ""
    """Argo's node status of the (last) attempt: Succeeded, Failed (non-zero exit), Error (did not run)."""
    exit_code: int | None = None


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
        parallelism: int | None = None,
    ) -> None:
        self.workflow = workflow
        #: Most tasks running at once (None: no limit): ``parallelism``, else the workflow's own.
        self.parallelism = parallelism or workflow.spec.parallelism or None
        self._lock = threading.Lock()
        self._stop = threading.Event()
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
        self.warm = ScopedServer()

    def run(self) -> RunResult:
        """Run every task (or report it Omitted); never raises for a task that fails."""
        started = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "workflow.yaml").write_text(_to_yaml(self.workflow, self.name))
        log.info(
            "pipeline_started",
            workflow=self.name,
            tasks=len(self.plan.tasks),
            parallelism=self.parallelism or "unlimited",
            folder=str(self.folder),
        )
        results: dict[str, StepResult] = {}
        pending = list(self.plan.tasks)
        running: dict[Future[list[StepResult]], PlannedTask] = {}
        limit = self.parallelism or len(pending) or 1
        wanted = any(_runs_warm(task.template) for task in self.plan.tasks)
        with (
            ScopedServer.around(wanted) as self.warm,
            ThreadPoolExecutor(max_workers=limit, thread_name_prefix="task") as pool,
            self._stopping(),
        ):
            while pending or running:
                for task in list(pending):
                    omitted = self._omission(task, results)
                    if omitted is not None:
                        results[task.name] = omitted
                        pending.remove(task)
                for task in list(pending):
                    ready = all(results.get(d) is not None for d in task.dependencies)
                    if ready and len(running) < limit:
                        pending.remove(task)
                        running[pool.submit(self._run_to_the_end, task)] = task
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    running.pop(future)
                    for step in future.result():
                        results[step.name] = step
        order = [name for task in self.plan.tasks for name in (task.name, f"{task.name}.onExit")]
        steps = [results[name] for name in order if name in results]
        result = RunResult(self.name, self.folder, steps, time.monotonic() - started)
        failed = result.failed
        if failed is None:
            log.info("pipeline_succeeded", workflow=self.name, seconds=round(result.seconds, 1))
        else:
            log.error("pipeline_failed", workflow=self.name, step=failed.name, error=failed.message)
        return result

    @contextlib.contextmanager
    def _stopping(self) -> Iterator[None]:
        """On Ctrl-C (or any error) in the runner's thread, stop the steps running in the pool's threads."""
        try:
            yield
        except BaseException:
            self._stop.set()
            raise

    def _omission(self, task: PlannedTask, results: dict[str, StepResult]) -> StepResult | None:
        """The result of a task that must not run because of a failure before it, else None."""
        blocked = next(
            (d for d in task.dependencies if d in results and results[d].phase is not Phase.SUCCEEDED), None
        )
        failed = next((r.name for r in results.values() if r.phase is Phase.FAILED), None)
        if blocked is not None:
            message = f"not run: it depends on {blocked}, which did not succeed"
        elif failed is not None and self.plan.fail_fast:
            message = f"not run: {failed} failed and the DAG fails fast"
        else:
            return None
        log.warning("step_omitted", step=task.name, reason=message)
        return StepResult(task.name, task.template.name or "", Phase.OMITTED, message)

    def _run_to_the_end(self, task: PlannedTask) -> list[StepResult]:
        """Run ``task`` with its retries, then its exit hook; returns their results (a thread of the pool)."""
        results = [self._run_with_retries(task)]
        if task.exit_hook is not None:
            results.append(self._run_with_retries(task.exit_hook))
        return results

    def _run_with_retries(self, task: PlannedTask) -> StepResult:
        """Run ``task`` until it succeeds or its ``retryStrategy`` says to stop (see the module docstring)."""
        strategy = task.template.retry_strategy
        first_started = time.monotonic()
        attempt = 0
        try:
            max_duration = _retry_bound(strategy, task_scope(task, self._scope_for(task)), task.name)
        except EdlError as error:
            log.error("step_failed", step=task.name, error=str(error))
            return StepResult(task.name, task.template.name or "", Phase.FAILED, str(error), status="Error")
        while True:
            left = None if max_duration is None else max_duration - (time.monotonic() - first_started)
            result = self._run_task(task, deadline_cap=left)
            result.attempts, result.started = attempt + 1, first_started
            if result.phase is Phase.SUCCEEDED or strategy is None:
                return result
            delay = _retry_delay(strategy, attempt, task.name)
            elapsed = time.monotonic() - first_started
            if not _should_retry(strategy, result, attempt) or (
                max_duration is not None and elapsed + delay >= max_duration
            ):
                return result
            attempt += 1
            log.warning("step_retried", step=task.name, attempt=attempt, after=result.message, delay_s=delay)
            if self._stop.wait(delay):
                return result

    def _run_task(self, task: PlannedTask, deadline_cap: float | None = None) -> StepResult:
        started = time.monotonic()
        result = StepResult(task.name, task.template.name or "", Phase.FAILED)
        result.status = "Error"
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
            deadline = invocation.deadline_seconds
            if deadline_cap is not None:
                deadline = max(1.0, min(deadline if deadline is not None else deadline_cap, deadline_cap))
            if runs_warm(invocation.argv[1:]):
                self.warm.wait_until_ready()
            if self._stop.is_set():
                raise KeyboardInterrupt
            ended = run_process(
                invocation.argv,
                invocation.env,
                task.name,
                context.sandbox / "progress",
                deadline,
                self.sink,
                self._stop,
            )
            result.status, result.exit_code = "Failed", ended.exit_code
            if ended.exit_code == 0:
                self._collect_outputs(task, invocation, result)
                result.phase, result.status = Phase.SUCCEEDED, "Succeeded"
            else:
                result.message = _failure(ended, deadline)
        except EdlError as error:
            result.message = str(error)
        result.seconds = time.monotonic() - started
        if result.phase is Phase.SUCCEEDED:
            log.info("step_succeeded", step=task.name, seconds=round(result.seconds, 1))
        else:
            log.error("step_failed", step=task.name, error=result.message)
        return result

    def _scope_for(self, task: PlannedTask) -> dict[str, str]:
        """The tags ``task``'s template fields may use, as of now (a copy: tasks run in parallel)."""
        with self._lock:
            return dict(self.scope)

    def _context(self, task: PlannedTask) -> Context:
        with self._lock:
            scope, artifact_keys = dict(self.scope), dict(self.artifact_keys)
        return Context(
            scope=scope,
            artifact_keys=artifact_keys,
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
            with self._lock:
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
            with self._lock:
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


def _runs_warm(template: Template) -> bool:
    """Whether ``template``'s container runs a command a warm server runs (``edl-argo train ...``)."""
    container = template.container
    argv = [*(container.command or []), *(container.args or [])] if container else []
    return runs_warm(argv[1:])


def _failure(ended: ProcessResult, deadline_seconds: float | None) -> str:
    """Why a step's process failed, on one line: its own error line if it printed one."""
    lines = [line.strip() for line in ended.last_lines if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    if ended.timed_out:
        return f"{DEADLINE_MESSAGE} (activeDeadlineSeconds={deadline_seconds:.0f})"
    detail = errors[-1] if errors else (lines[-1] if lines else "no output")
    return f"exit code {ended.exit_code}: {detail}"


def _retry_bound(strategy: RetryStrategy | None, scope: dict[str, str], where: str) -> float | None:
    """``backoff.maxDuration`` in seconds (tags replaced), or None."""
    backoff = strategy.backoff if strategy is not None else None
    if backoff is None or backoff.max_duration is None:
        return None
    return _seconds(substitute(str(backoff.max_duration), scope, f"task {where}"), where)


def _retry_delay(strategy: RetryStrategy, attempt: int, where: str) -> float:
    """Seconds before retry number ``attempt + 1``: ``duration * factor ** attempt`` (0 without backoff)."""
    backoff = strategy.backoff
    if backoff is None or backoff.duration is None:
        return 0.0
    factor = float(str(backoff.factor.root)) if backoff.factor is not None else 1.0
    delay = _seconds(str(backoff.duration), where) * factor**attempt
    if backoff.cap:
        delay = min(delay, _seconds(str(backoff.cap), where))
    return delay


def _should_retry(strategy: RetryStrategy, result: StepResult, attempt: int) -> bool:
    """Whether the failed attempt number ``attempt`` (from 0) is retried: limit, policy and expression."""
    limit = strategy.limit
    if limit is not None and attempt >= int(str(limit.root)):
        return False
    policy = str(strategy.retry_policy or ("Always" if strategy.expression else "OnFailure"))
    allowed = {"Always": ("Failed", "Error"), "OnFailure": ("Failed",), "OnError": ("Error",)}
    if result.status not in allowed.get(policy, ()):
        return False
    if not strategy.expression:
        return True
    variables = {
        "lastRetry.exitCode": "" if result.exit_code is None else str(result.exit_code),
        "lastRetry.status": result.status,
        "lastRetry.duration": str(round(result.seconds)),
        "lastRetry.message": result.message,
        "retries": attempt,
    }
    return bool(evaluate(strategy.expression, variables))


def _seconds(text: str, where: str) -> float:
    """A duration as Argo writes them (``30``, ``30s``, ``2m``, ``1h``) in seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*", text)
    if match is None:
        raise ConfigError(f"task {where}: {text!r} is not a duration (seconds, or 30s, 2m, 1h)")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]


def _suffix() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))


def _to_yaml(workflow: WorkflowModel, name: str) -> str:
    import yaml

    manifest = workflow.model_dump(by_alias=True, exclude_none=True, mode="json")
    manifest["metadata"] = {**manifest.get("metadata", {}), "name": name}
    manifest["metadata"].pop("generateName", None)
    return yaml.safe_dump(manifest, sort_keys=False)
