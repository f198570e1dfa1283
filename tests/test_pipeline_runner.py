"""The local pipeline runner on small workflows (``edl-argo data`` steps only: no training, seconds each)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hera.workflows import (
    DAG,
    Container,
    ExistingVolume,
    Parameter,
    RawArtifact,
    RetryStrategy,
    Script,
    SecretVolume,
    Task,
    Workflow,
)
from hera.workflows.models import Arguments, Backoff, IntOrString, LifecycleHook, TemplateRef
from hera.workflows.models import Parameter as ModelParameter

from edl_argo.errors import ConfigError
from edl_argo.hera import IMAGE_HOME, convert_csv, prepare_digits
from edl_argo.pipeline.filesystem import ContainerFilesystem, source_root
from edl_argo.pipeline.invocation import _on_this_machine
from edl_argo.pipeline.loader import load_workflow, with_parameters
from edl_argo.pipeline.runner import DEADLINE_MESSAGE, LocalRunner, Phase
from tests.test_cli import error_lines, run_cli


def inspect_template() -> Container:
    """A step that fails (exit 2, one error line) when its ``url`` holds no shards."""
    return Container(
        name="inspect",
        image="edl-argo:test",
        command=["edl-argo", "data", "inspect", "{{inputs.parameters.url}}"],
        inputs=[Parameter(name="url")],
    )


def test_ready_tasks_start_at_once_and_a_failure_stops_only_tasks_not_started(capsys, tmp_path: Path) -> None:
    """As Argo: the roots ``bad`` and ``prepare-digits`` start together; ``bad`` fails at once, yet
    ``prepare-digits`` (already running) finishes; failFast then omits what had not started."""
    with Workflow(name="failing", entrypoint="main") as workflow, DAG(name="main"):
        inspect = inspect_template()
        data = prepare_digits(output=str(tmp_path / "data"), shards=1)
        bad = inspect(name="bad", arguments={"url": str(tmp_path / "nowhere")})
        after_bad = inspect(name="after-bad", arguments={"url": str(tmp_path / "data" / "train")})
        after_data = inspect(name="after-data", arguments={"url": str(tmp_path / "data" / "test")})
        bad >> after_bad
        data >> after_data
    (tmp_path / "failing.yaml").write_text(workflow.to_yaml())

    code, out, err = run_cli(
        capsys, "pipeline", "run", str(tmp_path / "failing.yaml"), "--workdir", str(tmp_path / "runs")
    )

    assert code == 1
    (line,) = [line for line in error_lines(err) if not line.startswith("[")]
    assert "step bad failed" in line and "nowhere" in line and "Traceback" not in err
    assert "[bad] edl-argo data: error: " in err and "no data there" in err  # the step's log, prefixed
    summary = out.splitlines()
    assert summary[0].startswith("pipeline failing failed: step bad failed")
    assert [row.split()[:2] for row in summary[1:]] == [
        ["prepare-digits", "Succeeded"],  # started with bad, not stopped by its failure
        ["bad", "Failed"],
        ["after-bad", "Omitted"],
        ["after-data", "Omitted"],
    ]
    assert "it depends on bad" in summary[3] and "bad failed and the DAG fails fast" in summary[4]


def test_parallelism_limits_the_tasks_running_at_once(tmp_path: Path) -> None:
    def workflow() -> Workflow:
        with Workflow(name="wide", entrypoint="main") as built, DAG(name="main"):
            for name in ("a", "b", "c"):
                prepare_digits(name, output=str(tmp_path / name), shards=1)
        return built

    together = LocalRunner(workflow().build(), tmp_path / "runs").run()
    one_by_one = LocalRunner(workflow().build(), tmp_path / "runs", parallelism=1).run()

    def overlaps(steps: list) -> int:
        spans = [(s.started, s.started + s.seconds) for s in steps]
        return sum(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1 :])

    assert [s.phase for s in together.steps + one_by_one.steps] == [Phase.SUCCEEDED] * 6
    assert overlaps(together.steps) == 3  # all three ran at the same time
    assert overlaps(one_by_one.steps) == 0


def test_retry_strategy_limit_expression_and_backoff_are_honoured(tmp_path: Path) -> None:
    def failing(name: str, **retry: Any) -> None:
        Container(
            name=name,
            image="edl-argo:test",
            command=["edl-argo", "data", "inspect", str(tmp_path / "nowhere")],  # exit 2 every time
            retry_strategy=RetryStrategy(**retry),
        )(name=name)

    with Workflow(name="retries", entrypoint="main") as workflow, DAG(name="main", fail_fast=False):
        failing(
            "limited", limit=2, retry_policy="Always", backoff=Backoff(duration="1s", factor=IntOrString(2))
        )
        failing("expression", limit=3, expression="asInt(lastRetry.exitCode) > 2")
        failing("bounded", limit=5, backoff=Backoff(duration="1s", factor=IntOrString(2), max_duration="8"))

    result = LocalRunner(workflow.build(), tmp_path / "runs").run()

    limited, expression, bounded = (result.step(name) for name in ("limited", "expression", "bounded"))
    assert [s.phase for s in (limited, expression, bounded)] == [Phase.FAILED] * 3
    assert limited.attempts == 3  # the first run and two retries, 1 s then 2 s apart
    assert expression.attempts == 1  # exit code 2: the expression says no
    # The limit allows 6 attempts; maxDuration 8 s stops them after 4 at most, however fast an attempt is
    # (the retries wait 1, 2, 4 s: a 5th would start after 7 s of waits alone, and wait 8 s more), and
    # allows a 2nd unless the first attempt took 7 s.
    assert 1 < bounded.attempts <= 4


def test_a_step_past_its_deadline_is_stopped_and_its_exit_hook_still_runs(tmp_path: Path) -> None:
    with Workflow(name="slow", entrypoint="main") as workflow, DAG(name="main"):
        inspect_template()  # the hook's template, in the workflow
        generate = Container(
            name="generate",
            image="edl-argo:test",
            command=["edl-argo", "data", "ctr", "--output", str(tmp_path / "ctr"), "--records", "300000"],
            active_deadline_seconds=2,
        )(name="generate")
        generate.hooks = {
            "exit": LifecycleHook(
                template="inspect",
                arguments=Arguments(parameters=[ModelParameter(name="url", value=str(tmp_path / "nowhere"))]),
            )
        }

    result = LocalRunner(workflow.build(), tmp_path / "runs").run()

    step, hook = result.steps
    assert step.phase is Phase.FAILED and step.message.startswith(DEADLINE_MESSAGE)
    assert "(activeDeadlineSeconds=2)" in step.message
    assert step.seconds < 30
    assert hook.name == "generate.onExit" and hook.phase is Phase.FAILED
    assert "no data there" in hook.message


def test_a_referenced_template_runs_with_raw_artifacts_at_their_paths(tmp_path: Path) -> None:
    with Workflow(name="csv", entrypoint="main") as workflow, DAG(name="main"):
        csv = RawArtifact(name="csv", data="a,b,label\n1,x,0\n2.5,y,1\n3,z,1\n")
        convert_csv(
            csv=csv, label_column="label", output=str(tmp_path / "dataset"), shards=2, template_ref=True
        )

    result = LocalRunner(workflow.build(), tmp_path / "runs").run()

    assert [s.phase for s in result.steps] == [Phase.SUCCEEDED], result.steps[0].message
    assert sorted(p.name for p in (tmp_path / "dataset").glob("v-*/*") if "edl-index" not in p.name) == [
        "data-00000",
        "data-00001",
    ]
    assert (result.folder / "steps" / "convert-csv" / "tmp" / "input.csv").read_text().startswith("a,b,label")


def _workflow_with(make_task) -> Workflow:
    with Workflow(name="refused", entrypoint="main") as workflow, DAG(name="main"):
        make_task()
    return workflow


@pytest.mark.parametrize(
    ("make_task", "message"),
    [
        (
            lambda: Container(name="echo", image="alpine:3.20", command=["echo", "hi"])(name="echo"),
            "task echo (template echo) runs 'echo' in image alpine:3.20; the local runner only runs `edl",
        ),
        (
            lambda: Script(name="py", image="python:3.11", source="print(1)", command=["python"])(name="py"),
            "task py (template py) is a script",
        ),
        (
            lambda: inspect_template()(name="maybe", arguments={"url": "x"}, when="{{workflow.name}} == x"),
            "task maybe uses when",
        ),
        (
            lambda: Task(name="other", template_ref=TemplateRef(name="someone-elses", template="step")),
            "templateRef someone-elses/step is not an edl-argo WorkflowTemplate",
        ),
        (
            lambda: Container(
                name="pvc",
                image="edl-argo:test",
                command=["edl-argo", "data", "inspect", "/data"],
                volumes=[ExistingVolume(name="data", claim_name="data", mount_path="/data")],
            )(name="pvc"),
            "task pvc (template pvc) uses volume data, which the local runner cannot provide",
        ),
        (
            lambda: Container(
                name="secret",
                image="edl-argo:test",
                command=["edl-argo", "data", "inspect", "/s"],
                volumes=[SecretVolume(name="s", secret_name="s", mount_path="/s")],  # not optional
            )(name="secret"),
            "task secret (template secret) uses volume s, which the local runner cannot provide",
        ),
    ],
    ids=["other-image", "script", "when", "unknown-template-ref", "pvc", "required-secret"],
)
def test_what_cannot_run_here_is_refused_before_anything_runs(
    make_task, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LocalRunner(_workflow_with(make_task).build(), tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_the_training_steps_optional_secret_volumes_are_planned_and_mount_nothing(tmp_path: Path) -> None:
    """The elastic-train master's pod mounts its Secrets as optional volumes, which are empty without the
    Secrets: locally, where there are none, the runner plans the step and mounts nothing."""
    workflow = load_workflow(Path(__file__).parents[1] / "examples" / "pipelines" / "digits_pipeline.py")
    runner = LocalRunner(workflow, tmp_path / "runs")
    (train,) = [t for t in runner.plan.tasks if t.template.name == "elastic-train"]
    assert train.template.volumes and all(v.secret and v.secret.optional for v in train.template.volumes)


def test_container_paths_map_to_the_sandbox_and_the_image_home_to_this_project(tmp_path: Path) -> None:
    filesystem = ContainerFilesystem(tmp_path, ("/tmp/edl-job/model", "/tmp/model"), source_root())

    assert filesystem.localize("/tmp/edl-job") == f"{tmp_path}/tmp/edl-job"  # above a declared path
    assert filesystem.localize("--model=/tmp/model") == f"--model={tmp_path}/tmp/model"
    assert filesystem.localize("/tmp/models") == "/tmp/models"  # a host path, not the container's
    assert filesystem.localize("s3://bucket/tmp/model") == "s3://bucket/tmp/model"
    zoo = f"{IMAGE_HOME}/examples/model_zoo/digits.py:custom_model"
    assert filesystem.localize(zoo) == f"{source_root()}/examples/model_zoo/digits.py:custom_model"
    with pytest.raises(ConfigError, match=r"missing\.py"):
        filesystem.localize(f"{IMAGE_HOME}/missing.py")


def test_training_runs_its_pods_with_the_local_backend() -> None:
    assert _on_this_machine(["edl-argo", "train", "--backend", "kubernetes", "--image", "x"]) == [
        "edl-argo", "train", "--backend", "local", "--image", "x"
    ]  # fmt: skip
    assert _on_this_machine(["edl-argo", "train", "--backend=kubernetes"])[2] == "--backend=local"
    assert _on_this_machine(["edl-argo", "evaluate", "--backend", "x"])[3] == "x"


def test_parameters_must_be_declared_by_the_workflow(tmp_path: Path) -> None:
    workflow = load_workflow(Path(__file__).parents[1] / "examples" / "pipelines" / "digits_pipeline.py")
    parameters = with_parameters(workflow, {"epochs": "3"}).spec.arguments.parameters
    assert {p.name: p.value for p in parameters}["epochs"] == "3"
    with pytest.raises(ConfigError, match=r"no parameter 'epoch' .*epochs"):
        with_parameters(workflow, {"epoch": "3"})
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="defines no `workflow`"):
        load_workflow(tmp_path / "empty.py")


@pytest.mark.parametrize("flag", ["--workdir", "--artifacts"])
def test_a_run_folder_below_a_regular_file_is_one_line_before_anything_runs(
    capsys, flag: str, tmp_path: Path
) -> None:
    (tmp_path / "afile").write_text("mine")
    below = str(tmp_path / "afile" / "runs")
    flags = {"--workdir": tmp_path / "runs", flag: below}
    pipeline = Path(__file__).parents[1] / "examples" / "pipelines" / "digits_pipeline.py"
    argv = ["pipeline", "run", str(pipeline), *(str(part) for item in flags.items() for part in item)]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    (line,) = error_lines(err)
    assert f"{flag} {below}: {tmp_path / 'afile'} is a file, not a folder" in line, line
    assert not (tmp_path / "runs").exists()  # nothing ran
    assert (tmp_path / "afile").read_text() == "mine"
