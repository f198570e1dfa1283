"""templates/ and the example pipelines: fresh, valid for Argo and Hera, and meaningful.

Meaningful: every step's command is a real ``edl-argo`` command line that the project's own parser
accepts once Argo has filled in its parameters; every artifact a task consumes is produced by a task it
depends on; the elastic-train step has the cluster settings the master relies on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from hera.workflows import DAG, Workflow, WorkflowTemplate

import edl_argo.hera
from edl_argo import cli
from edl_argo.hera import MODEL_ZOO, STEPS, elastic_train, evaluate, predict, prepare_digits
from edl_argo.hera.render import render, stale_files
from edl_argo.master.config import config_from_args
from edl_argo.pipeline.loader import load_workflow
from edl_argo.pipeline.variables import substitute
from tests.argo_steps import argo_pod, parameter_values, step_template, training_tasks
from tests.manifests import ARGO, ROOT, load_documents, schema_errors, validate

TEMPLATES = ROOT / "templates"
CLUSTER_EXAMPLES = ROOT / "examples" / "cluster"
PIPELINES = sorted((ROOT / "examples" / "pipelines").glob("*.py"))
HERA_CLASSES = {"Workflow": Workflow, "WorkflowTemplate": WorkflowTemplate}
#: Values for the required parameters of the steps (the others have defaults).
REQUIRED = {
    "model-def": f"{MODEL_ZOO}/digits.py",
    "training-data": "s3://data/digits/train",
    "data": "s3://data/digits/test",
    "output": "s3://data/digits",
    "label-column": "label",
    "statement": "SELECT * FROM census TO TRAIN DNNClassifier LABEL income INTO m",
    "db": "postgresql://edl@db:5432/census",
    "models": "s3://data/models",
    "table": "census",
}
#: Example pipelines of SQL steps only: no training task (its job runs inside the sql step), no artifacts
#: (models and tables are named by URL).
SQL_PIPELINES = {"census_sql_pipeline.py"}
WORKFLOW_VARIABLES = {"workflow.name": "digits-x7k2p", "workflow.uid": "0f6c1d", "workflow.namespace": "argo"}


def rendered_documents() -> list[tuple[str, dict[str, Any]]]:
    """(source, manifest) of every file in templates/ and of every example pipeline."""
    documents = [
        (path.name, doc)
        for folder in (TEMPLATES, CLUSTER_EXAMPLES)
        for path in sorted(folder.glob("*.yaml"))
        for doc in load_documents(path)
    ]
    documents += [(path.name, _manifest(path)) for path in PIPELINES]
    return documents


def _manifest(pipeline: Path) -> dict[str, Any]:
    return load_workflow(pipeline).model_dump(by_alias=True, exclude_none=True, mode="json")


def container_templates() -> list[dict[str, Any]]:
    """Every distinct container template of the rendered manifests."""
    templates = {
        json.dumps(template, sort_keys=True): template
        for _, document in rendered_documents()
        if document["kind"] in HERA_CLASSES
        for template in document["spec"]["templates"]
        if "container" in template
    }
    return list(templates.values())


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda path: path.name)
def test_a_pipeline_file_prints_its_workflow(pipeline: Path) -> None:
    printed = subprocess.run(
        [sys.executable, str(pipeline)], capture_output=True, text=True, check=True
    ).stdout
    assert yaml.safe_load(printed) == _manifest(pipeline)


def test_templates_are_rendered_from_the_current_components() -> None:
    assert stale_files(render(ROOT / "components"), TEMPLATES) == [], (
        "templates/ is stale: run `make templates`"
    )
    assert stale_files(render(CLUSTER_EXAMPLES), CLUSTER_EXAMPLES) == [], (
        "examples/cluster/ is stale: run `make templates`"
    )


def test_templates_install_only_edl_argos_own_objects() -> None:
    """`kubectl apply -f templates/` must not replace a namespace's settings (its artifact repository, its
    Secrets): every object is edl-argo's, named edl-argo-*."""
    for path in sorted(TEMPLATES.glob("*.yaml")):
        for document in load_documents(path):
            meta = document["metadata"]
            assert document["kind"] not in ("ConfigMap", "Secret"), f"{path.name}: {document['kind']}"
            assert meta["labels"]["app.kubernetes.io/part-of"] == "edl-argo", path.name
            assert meta["name"].startswith("edl-argo-"), f"{path.name}: {meta['name']}"
    (minio,) = [path.read_text() for path in CLUSTER_EXAMPLES.glob("*.yaml")]
    assert "REPLACES the namespace's ConfigMap artifact-repositories" in minio.split("apiVersion", 1)[0]


def test_templates_install_every_step() -> None:
    installed = [
        (document["metadata"]["name"], template["name"])
        for _, document in rendered_documents()
        if document["kind"] == "WorkflowTemplate"
        for template in document["spec"]["templates"]
    ]
    assert sorted(installed) == sorted((step.workflow_template, step.name) for step in STEPS)


@pytest.mark.parametrize(
    ("source", "manifest"), rendered_documents(), ids=lambda value: value if isinstance(value, str) else ""
)
def test_every_manifest_is_valid(source: str, manifest: dict[str, Any]) -> None:
    validate(manifest)
    kind = manifest["kind"]
    if kind in HERA_CLASSES:
        assert HERA_CLASSES[kind].from_dict(manifest).to_dict() == manifest, (
            f"{source}: Hera reads it otherwise"
        )
    if kind == "ConfigMap":  # the artifact repository
        for key, text in manifest["data"].items():
            assert not schema_errors(yaml.safe_load(text), f"{ARGO}.ArtifactRepository"), f"{source} {key}"


@pytest.mark.parametrize("template", container_templates(), ids=lambda template: template["name"])
def test_every_step_command_is_an_edl_argo_command_line(template: dict[str, Any]) -> None:
    """Fill in the parameters as Argo would (defaults, themselves filled in with the workflow's variables,
    or sample values), then parse like `edl-argo`."""
    inputs = template.get("inputs", {})
    scope = {
        **WORKFLOW_VARIABLES,
        **{
            f"inputs.parameters.{p['name']}": substitute(
                p.get("default", REQUIRED.get(p["name"])), WORKFLOW_VARIABLES, p["name"]
            )
            for p in inputs["parameters"]
        },
        **{f"inputs.artifacts.{a['name']}.path": a["path"] for a in inputs.get("artifacts", [])},
    }
    argv = substitute(template["container"]["command"] + template["container"].get("args", []), scope, "test")
    assert argv[0] == "edl-argo"
    try:
        args = cli.build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{template['name']}: edl-argo rejects {' '.join(argv)}")
    if args.command == "train":
        config = config_from_args(args)  # the Kubernetes settings too: quantities, names
        assert config.backend == "kubernetes" and config.kubernetes is not None
        assert config.kubernetes.worker.priority_class and config.kubernetes.ps.priority_class


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda path: path.name)
def test_artifacts_flow_from_producers_to_consumers(pipeline: Path) -> None:
    spec = _manifest(pipeline)["spec"]
    templates = {t["name"]: t for t in spec["templates"]}
    tasks = {t["name"]: t for t in templates[spec["entrypoint"]]["dag"]["tasks"]}
    consumed = 0
    for task in tasks.values():
        declared = {a["name"] for a in step_template(task, templates).get("inputs", {}).get("artifacts", [])}
        for artifact in task.get("arguments", {}).get("artifacts", []):
            _, producer, _, kind, name = artifact["from"].strip("{}").split(".")
            assert kind == "artifacts" and artifact["name"] in declared
            outputs = step_template(tasks[producer], templates)["outputs"]["artifacts"]
            assert name in {a["name"] for a in outputs}, f"{producer} outputs no artifact {name}"
            assert producer in _ancestors(task["name"], tasks), f"{task['name']} does not wait for {producer}"
            consumed += 1
    assert consumed >= 1 or pipeline.name in SQL_PIPELINES


def _ancestors(name: str, tasks: dict[str, Any]) -> set[str]:
    parents = {p.split(".")[0] for p in tasks[name].get("depends", "").split(" && ") if p}
    return parents.union(*(_ancestors(parent, tasks) for parent in parents))


def test_the_train_step_has_what_the_master_relies_on() -> None:
    (document,) = load_documents(TEMPLATES / "elastic-train.yaml")
    template, cleanup = document["spec"]["templates"]
    rbac = {d["kind"]: d for d in load_documents(TEMPLATES / "rbac.yaml")}
    priorities = {d["metadata"]["name"] for d in load_documents(TEMPLATES / "priority-classes.yaml")}
    defaults = {p["name"]: p.get("default") for p in template["inputs"]["parameters"]}

    assert template["serviceAccountName"] == rbac["ServiceAccount"]["metadata"]["name"] == "edl-argo-master"
    assert cleanup["serviceAccountName"] == "edl-argo-master"
    assert cleanup["container"]["command"] == [
        "edl-argo", "cleanup", "--backend", "kubernetes", "--job-name", "{{inputs.parameters.job-name}}"
    ]  # fmt: skip
    assert {"pods", "services", "workflowtaskresults"} <= {
        r for rule in rbac["Role"]["rules"] for r in rule["resources"]
    }
    assert {
        defaults["worker-pod-priority"],
        defaults["ps-pod-priority"],
        defaults["master-pod-priority"],
    } <= priorities
    assert template["retryStrategy"]["limit"] >= 1 and "lastRetry" in template["retryStrategy"]["expression"]
    assert template["activeDeadlineSeconds"] == "{{inputs.parameters.active-deadline-seconds}}"
    fields = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in template["container"]["env"]
        if "fieldRef" in e.get("valueFrom", {})
    }
    secrets = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in template["container"]["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert secrets == {
        "EDL_DB_PASSWORD": {"name": "{{inputs.parameters.db-secret}}", "key": "password", "optional": True}
    }
    assert fields == {
        "EDL_POD_NAME": "metadata.name",
        "EDL_POD_UID": "metadata.uid",
        "EDL_NAMESPACE": "metadata.namespace",  # the owner's: --namespace must not differ
        "POD_IP": "status.podIP",
    }
    assert template["container"]["command"][:4] == ["edl-argo", "train", "--backend", "kubernetes"]
    outputs = template["outputs"]
    assert [a["name"] for a in outputs["artifacts"]] == ["model", "tensorboard"]
    assert (
        outputs["parameters"][0]["valueFrom"]["path"] in template["container"]["command"]
    )  # --metrics-output
    # The master reads no Secret through the API: its pod mounts the job's auth Secret (which a restarted
    # master reads back) and the --tls-secret Secret, both optional (the first master creates the former;
    # without TLS the latter names no Secret of edl-argo's), read-only, under $EDL_MASTER_SECRETS_DIR.
    volumes = {v["name"]: v["secret"] for v in template["volumes"]}
    mode = 0o440  # the owner and the pod's group (fsGroup): the master runs as neither root nor other
    assert volumes == {
        "job-auth": {
            "secretName": "{{inputs.parameters.job-name}}-auth",
            "optional": True,
            "defaultMode": mode,
        },
        "tls": {
            "secretName": "{{=sprig.default('edl-argo-no-tls', inputs.parameters['tls-secret'])}}",
            "optional": True,
            "defaultMode": mode,
        },
    }
    env = {e["name"]: e.get("value") for e in template["container"]["env"]}
    assert {
        m["name"]: (m["mountPath"], m.get("readOnly")) for m in template["container"]["volumeMounts"]
    } == {name: (f"{env['EDL_MASTER_SECRETS_DIR']}/{name}", True) for name in volumes}
    command = template["container"]["command"]
    assert command[command.index("--tls-secret") + 1] == "{{inputs.parameters.tls-secret}}"


def test_steps_by_template_ref_name_the_installed_templates() -> None:
    with Workflow(generate_name="ref-", entrypoint="main") as workflow, DAG(name="main"):
        data = prepare_digits(output="s3://d/digits", template_ref=True)
        train = elastic_train(
            model_def=f"{MODEL_ZOO}/digits.py", training_data="s3://d/digits/train", template_ref=True
        )
        data >> train
        evaluate(
            model=train.get_artifact("model"),
            model_def=f"{MODEL_ZOO}/digits.py",
            data="s3://d/t",
            template_ref=True,
        )
        predict(
            model=train.get_artifact("model"),
            model_def=f"{MODEL_ZOO}/digits.py",
            data="s3://d/t",
            template_ref=True,
        )
    manifest = workflow.to_dict()
    validate(manifest)
    (dag,) = manifest["spec"]["templates"]  # nothing embedded
    installed = {
        (document["metadata"]["name"], template["name"])
        for _, document in rendered_documents()
        if document["kind"] == "WorkflowTemplate"
        for template in document["spec"]["templates"]
    }
    refs = {(t["templateRef"]["name"], t["templateRef"]["template"]) for t in dag["dag"]["tasks"]}
    assert refs <= installed and len(refs) == 4
    (train_task,) = [t for t in dag["dag"]["tasks"] if t["name"] == "elastic-train"]
    hook = train_task["hooks"]["exit"]["templateRef"]
    assert (hook["name"], hook["template"]) in installed
    depends = {t["name"]: t.get("depends") for t in dag["dag"]["tasks"]}
    assert depends == {
        "prepare-digits": None,
        "elastic-train": "prepare-digits",
        "evaluate": "elastic-train",
        "predict": "elastic-train",
    }


def test_asking_a_step_for_an_output_it_lacks_names_the_ones_it_has() -> None:
    with Workflow(generate_name="x-", entrypoint="main"), DAG(name="main"):
        train = elastic_train(model_def="m.py", training_data="s3://d/train")
        with pytest.raises(KeyError, match="has no output artifact 'weights'; it has: model"):
            train.get_artifact("weights")
        assert train.get_parameter("metrics").value == "{{tasks.elastic-train.outputs.parameters.metrics}}"


def test_the_documented_example_builds_a_valid_workflow() -> None:
    readme = (ROOT / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert textwrap.indent(code, "    ") in (edl_argo.hera.__doc__ or ""), "README and edl_argo.hera differ"
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    manifest = namespace["workflow"].to_dict()
    validate(manifest)
    tasks = {t["name"]: t.get("depends") for t in manifest["spec"]["templates"][0]["dag"]["tasks"]}
    assert tasks == {"prepare-digits": None, "elastic-train": "prepare-digits", "evaluate": "elastic-train"}


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda p: p.stem)
def test_every_training_task_of_the_examples_has_an_exit_hook_cleaning_up_its_own_job(pipeline: Path) -> None:
    manifest = _manifest(pipeline)
    templates = {t["name"]: t for t in manifest["spec"]["templates"]}
    tasks = training_tasks(manifest)
    assert tasks or pipeline.name in SQL_PIPELINES
    for task, template in tasks:
        hook = task["hooks"]["exit"]
        hook_template = step_template(hook, templates)
        assert hook_template["container"]["command"][:2] == ["edl-argo", "cleanup"]
        hook_job = {p["name"]: p["value"] for p in hook["arguments"]["parameters"]}["job-name"]
        assert hook_job == parameter_values(task, template)["job-name"] == "{{workflow.name}}-" + task["name"]


@pytest.mark.parametrize("template_ref", [False, True], ids=["embedded", "template-ref"])
def test_two_training_tasks_of_one_workflow_run_two_jobs_each_cleaned_up_by_its_hook(
    template_ref: bool,
) -> None:
    with Workflow(generate_name="two-", entrypoint="main") as workflow, DAG(name="main"):
        for name in ("train-small", "train-large"):
            elastic_train(name, model_def="m.py", training_data="s3://d/train", template_ref=template_ref)
    manifest = workflow.to_dict()
    validate(manifest)
    tasks = training_tasks(manifest)
    variables = dict(WORKFLOW_VARIABLES)
    job_names = [parameter_values(task, template)["job-name"] for task, template in tasks]
    names = {substitute(name, variables, "test") for name in job_names}
    assert names == {"digits-x7k2p-train-small", "digits-x7k2p-train-large"}
    hooks = {
        p["value"]
        for task, _ in tasks
        for p in task["hooks"]["exit"]["arguments"]["parameters"]
        if p["name"] == "job-name"
    }
    assert {substitute(h, variables, "test") for h in hooks} == names
    if not template_ref:
        assert [t["name"] for t in manifest["spec"]["templates"]].count("elastic-train-cleanup") == 1


def test_the_training_steps_deadline_bounds_its_retries() -> None:
    """active-deadline-seconds is the pod's deadline and the retries' maxDuration (Argo then gives a retried
    pod only what is left of it), and a master stopped at its deadline is not retried."""
    from edl_argo.pipeline.expressions import evaluate

    (document,) = load_documents(TEMPLATES / "elastic-train.yaml")
    template = document["spec"]["templates"][0]
    strategy = template["retryStrategy"]
    assert strategy["backoff"]["maxDuration"] == template["activeDeadlineSeconds"]
    assert template["activeDeadlineSeconds"] == "{{inputs.parameters.active-deadline-seconds}}"

    def retried(status: str, exit_code: str, message: str = "") -> bool:
        variables = {
            "lastRetry.status": status,
            "lastRetry.exitCode": exit_code,
            "lastRetry.message": message,
            "lastRetry.duration": "60",
            "retries": 0,
        }
        return bool(evaluate(strategy["expression"], variables))

    assert retried("Error", "")  # lost its node
    assert retried("Failed", "137") and retried("Failed", "143")  # killed, drained
    assert not retried("Failed", "1") and not retried("Failed", "2")  # failed on its own, misconfigured
    assert not retried("Failed", "143", "Pod was active on the node longer than the specified deadline")
    assert not retried("Failed", "137", "Step exceeded its deadline")


def test_a_master_that_finished_is_never_retried_even_when_its_node_is_an_error() -> None:
    """Argo marks a node Error when only its wait container failed (the model artifact's upload to a
    misconfigured repository), with the main container's exit code 0 (the controller reads it from the pod);
    retrying that master would train the model again. A lost node (no exit code: -1) is retried."""
    from edl_argo.pipeline.expressions import evaluate

    (document,) = load_documents(TEMPLATES / "elastic-train.yaml")
    expression = document["spec"]["templates"][0]["retryStrategy"]["expression"]

    def retried(status: str, exit_code: str) -> bool:
        variables = {
            "lastRetry.status": status,
            "lastRetry.exitCode": exit_code,
            "lastRetry.message": "",
            "lastRetry.duration": "60",
            "retries": 0,
        }
        return bool(evaluate(expression, variables))

    assert not retried("Error", "0")  # trained and published; only the upload failed
    assert retried("Error", "-1") and retried("Error", "137")  # lost its node, killed with it


@pytest.mark.parametrize("job_name", ["", "my-job"], ids=["default-job-name", "given-job-name"])
def test_a_single_step_submit_of_the_workflow_template_cleans_up_its_job(job_name: str) -> None:
    """`argo submit --from workflowtemplate/edl-argo-elastic-train -p ...` runs the entry template alone, as
    a workflow whose spec is the WorkflowTemplate's: its exit handler (spec.onExit, given the workflow's
    arguments as the entry template is) must remove that job, and only the objects of that step."""
    from edl_argo.pods.manifests import kubernetes_job_name, step_identity

    (document,) = load_documents(TEMPLATES / "elastic-train.yaml")
    given = {"model-def": "m.py", "training-data": "s3://d/train"} | (
        {"job-name": job_name} if job_name else {}
    )
    spec = document["spec"] | {
        "arguments": {"parameters": [{"name": k, "value": v} for k, v in given.items()]}
    }
    workflow = {"apiVersion": document["apiVersion"], "kind": "Workflow", "metadata": {"name": "wf-1"}}
    validate(workflow | {"spec": spec})
    templates = {t["name"]: t for t in spec["templates"]}
    variables = {"workflow.name": "wf-1", "workflow.uid": "0f6c1d", "workflow.namespace": "argo"}

    def as_run(template_name: str) -> dict[str, Any]:
        task = {"template": template_name, "arguments": spec["arguments"]}
        return argo_pod(task, templates[template_name], variables)

    train = as_run(spec["entrypoint"])
    hook = as_run(spec["onExit"])
    assert hook["argv"][:2] == ["edl-argo", "cleanup"]
    train_args = cli.build_parser().parse_args(train["argv"][1:])
    hook_args = cli.build_parser().parse_args(hook["argv"][1:])
    assert kubernetes_job_name(hook_args.job_name) == config_from_args(train_args).job_name
    assert hook_args.job_name == (job_name or "wf-1")
    env = {e["name"]: e.get("value") for e in templates[spec["onExit"]]["container"]["env"]}
    assert env["EDL_NODE_NAME"] == "{{node.name}}"  # Argo's exit handler node: "wf-1.onExit"
    assert step_identity("0f6c1d", "wf-1.onExit") == step_identity("0f6c1d", "wf-1")  # the entry node


def test_the_steps_that_open_a_database_take_its_password_from_a_secret_never_from_arguments() -> None:
    """sql and prepare-census: EDL_DB_PASSWORD from the key password of the db-secret Secret, optional (a
    SQLite database needs none); the statement is the positional argument and --train-flags keeps its
    value's flags (--num-workers 2) from being read as flags of `edl-argo sql`."""
    documents = {path.stem: load_documents(path) for path in TEMPLATES.glob("*.yaml")}
    (sqlflow,) = documents["sqlflow"]
    (prepare,) = documents["prepare-data"]
    templates = [
        *sqlflow["spec"]["templates"],
        *(t for t in prepare["spec"]["templates"] if t["name"] == "prepare-census"),
    ]
    assert [t["name"] for t in templates] == ["sql", "prepare-census"]
    for template in templates:
        defaults = {p["name"]: p.get("default") for p in template["inputs"]["parameters"]}
        assert defaults["db-secret"] == "edl-argo-db"
        assert template["container"]["env"] == [
            {
                "name": "EDL_DB_PASSWORD",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": "{{inputs.parameters.db-secret}}",
                        "key": "password",
                        "optional": True,
                    }
                },
            }
        ]
        assert "db-secret" not in " ".join(template["container"]["command"])
    command = templates[0]["container"]["command"]
    assert command[:4] == [
        "edl-argo",
        "sql",
        "{{inputs.parameters.statement}}",
        "--train-flags={{inputs.parameters.train-flags}}",
    ]
    scope = {"inputs.parameters.statement": REQUIRED["statement"], "inputs.parameters.db": REQUIRED["db"]}
    scope |= {"inputs.parameters.models": "m", "inputs.parameters.train-flags": "--num-workers 2 --num-ps 1"}
    args = cli.build_parser().parse_args(substitute(command, scope, "test")[1:])
    assert args.statement == REQUIRED["statement"] and args.train_flags.split() == [
        "--num-workers", "2", "--num-ps", "1"
    ]  # fmt: skip
