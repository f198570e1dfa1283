"""elastic-train: the master of an elastic training job, ``edl-argo train --backend kubernetes``.

The step's pod is the job's master: it starts the worker and parameter-server pods itself, so it runs
under the ``edl-argo-master`` service account of ``templates/rbac.yaml``. It learns its pod's name, uid
and IP through the downward API and its workflow's name and uid from Argo; the pods it starts are owned
by the workflow (see :mod:`edl_argo.pods.kubernetes_config`). It writes ``N/M`` training tasks done to
``$ARGO_PROGRESS_FILE``, which Argo shows as the step's progress.

A master that is killed or loses its node (an exit by signal, an ``Error`` node) is retried; a job that
fails on its own (exit 1) or is misconfigured (exit 2) is not, nor one stopped by its deadline, nor a master
that exited 0 (its model trained and published) whose node is an ``Error`` because the upload of its
``model`` artifact failed: a retry would train it again.
``active-deadline-seconds`` bounds the whole step: it is the pod's ``activeDeadlineSeconds`` and the retry
strategy's ``backoff.maxDuration``, so retries stop once it has passed since the first attempt and a retried
master only gets what is left of it. The job name stays the same across
retries (the workflow's name by default), so a retried master adopts the pods of the one before. The
step's pod carries :data:`~edl_argo.pods.manifests.MASTER_POD_LABELS`; the master adds its job's name
(:func:`~edl_argo.pods.manifests.kubernetes_job_name`, shortened when too long for a label) as it starts,
so the ``<job>-master`` Service and the job's NetworkPolicy select it: the workers reach a retried master,
in its new pod, at the same address.

The master reads no Secret through the API (``templates/rbac.yaml`` grants no ``get`` on Secrets): the
step mounts the job's auth Secret (``<job-name>-auth``, which the master creates and a retried master reads
back) and the ``tls-secret`` Secret into its pod, as optional read-only volumes under
:data:`MASTER_SECRETS_DIR`.

Outputs: the ``model`` artifact, the model tree the job publishes (its pointer ``_edl-tree.json`` and the
version folder it names, holding ``saved_model/``, ``model.keras``, ``metrics.json``, ``flags.json``),
the ``tensorboard`` artifact, the TensorBoard event files of the job (optional: a job that ended before
writing any has none), and the ``metrics`` parameter, the job's final metrics as a JSON object
(``{"accuracy": 0.97}``).

Monitoring: the master serves its live metrics to Prometheus on :data:`METRICS_PORT`, the container port
named ``metrics``, and its pod carries the ``prometheus.io/scrape``, ``prometheus.io/port`` and
``prometheus.io/path`` annotations (docs/operations.md, "Monitoring a job").
"""

from __future__ import annotations

from typing import Annotated, Any

from hera.workflows import (
    Artifact,
    Container,
    Env,
    FieldEnv,
    Parameter,
    RetryPolicy,
    RetryStrategy,
    SecretVolume,
)
from hera.workflows.models import Backoff, ContainerPort, IntOrString, ResourceRequirements, ValueFrom

from edl_argo.hera.container import IMAGE, Image, step_container
from edl_argo.hera.inputs import Input, Int, StepInputs, Text
from edl_argo.hera.setting_inputs import with_setting_inputs
from edl_argo.hera.step import Step, StepTask
from edl_argo.master.tensorboard_log import TENSORBOARD_PREFIX
from edl_argo.pods.manifests import (
    MASTER_AUTH_VOLUME,
    MASTER_POD_LABELS,
    MASTER_SECRETS_ENV,
    MASTER_TLS_VOLUME,
    PORT_NAME,
    TLS_FILE_MODE,
)
from edl_argo.settings import table

WORKFLOW_TEMPLATE = "edl-argo-elastic-train"
#: The Kubernetes service account the master runs under (``templates/rbac.yaml``).
SERVICE_ACCOUNT = "edl-argo-master"
#: ``--output`` of the job inside the step's container.
JOB_DIR = "/tmp/edl-job"
#: The ``model`` output artifact: the model tree the job publishes under its output.
MODEL_DIR = f"{JOB_DIR}/model"
#: The ``metrics`` output parameter: the final metrics, written by ``--metrics-output``.
METRICS_FILE = f"{JOB_DIR}/final-metrics.json"
#: The master's gRPC port, declared as the container port named ``grpc`` so the job's NetworkPolicy admits
#: the job's workers to it, and fixed so a retried master serves where the workers look (its Service).
MASTER_PORT = 2221
#: The port the master serves its live metrics on (``--metrics-port``), declared as the container port named
#: :data:`METRICS_PORT_NAME`; the pod's ``prometheus.io/*`` annotations (:data:`SCRAPE_ANNOTATIONS`) tell a
#: Prometheus that discovers pods by them where to scrape.
METRICS_PORT = 8000
METRICS_PORT_NAME = "metrics"
METRICS_PATH = "/metrics"
SCRAPE_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": str(METRICS_PORT),
    "prometheus.io/path": METRICS_PATH,
}
#: The ``tensorboard`` output artifact: the TensorBoard event files the master writes under its output.
TENSORBOARD_DIR = f"{JOB_DIR}/{TENSORBOARD_PREFIX}"
#: How often a master that was killed or lost is started again.
MASTER_RETRIES = 2
#: Retry a master that was killed (exit by signal) or lost (an Error node), not a job that failed, nor one
#: stopped by its deadline (Argo's message for that names the deadline), nor a master that finished (exit
#: 0): Argo also marks a node Error when only its wait container failed (the model's upload), and a retry
#: would train the model again. Argo takes the exit code from the main container ("-1" when it has none).
RETRY_WHEN = (
    'lastRetry.exitCode != "0"'
    ' && (lastRetry.status == "Error" || asInt(lastRetry.exitCode) > 2)'
    ' && !(lastRetry.message contains "deadline")'
)
#: The exit hook of every elastic-train task (:func:`elastic_train_cleanup`).
CLEANUP_TEMPLATE = "elastic-train-cleanup"
#: How often a clean-up that failed (API server trouble) is tried again.
CLEANUP_RETRIES = 3
#: The job-name input's default in the template; a task's own default is ``<workflow>-<task>``.
DEFAULT_JOB_NAME = str(table.BY_FLAG["--job-name"].argo_default)
JobName = Input(table.BY_FLAG["--job-name"].argo.description)  # type: ignore[union-attr]
#: The master's environment: its pod (downward API) and its workflow (the owner of the job's pods).
POD_FIELDS = {
    "EDL_POD_NAME": "metadata.name",
    "EDL_POD_UID": "metadata.uid",
    "EDL_NAMESPACE": "metadata.namespace",
    "POD_IP": "status.podIP",
}
WORKFLOW_ENV = {
    "EDL_WORKFLOW_NAME": "{{workflow.name}}",
    "EDL_WORKFLOW_UID": "{{workflow.uid}}",
    "EDL_NODE_NAME": "{{node.name}}",
}
#: Where the master's pod mounts the Secrets the master reads (``$EDL_MASTER_SECRETS_DIR``): it reads none
#: through the API (its Role has no ``get`` on Secrets).
MASTER_SECRETS_DIR = "/etc/edl-argo/master"
#: The job's auth Secret, as the master names it (``manifests.auth_secret_name`` of the requested job name).
AUTH_SECRET = "{{inputs.parameters.job-name}}-auth"
#: A Secret volume needs a name; without ``--tls-secret`` the TLS volume names this one, which edl-argo
#: never creates: the volume is optional, so it stays empty, and the master does not look at it.
NO_TLS_SECRET = "edl-argo-no-tls"
TLS_SECRET = f"{{{{=sprig.default('{NO_TLS_SECRET}', inputs.parameters['tls-secret'])}}}}"
#: The exit hook's: what identifies the step whose job it removes (``manifests.step_identity``).
STEP_ENV = {name: WORKFLOW_ENV[name] for name in ("EDL_WORKFLOW_UID", "EDL_NODE_NAME")}


@with_setting_inputs(table.SETTINGS)
def elastic_train(
    name: str = "elastic-train",
    *,
    master_cpu: Annotated[Text, Input("CPU request of the master pod", flag=False)] = "1",
    master_memory: Annotated[Text, Input("memory request of the master pod", flag=False)] = "2Gi",
    active_deadline_seconds: Annotated[
        Int,
        Input(
            "seconds after which the whole step (its retries included) ends, and its job with it",
            flag=False,
        ),
    ] = 86_400,
    template_ref: bool = False,
    **settings: Any,
) -> StepTask:
    """Add an elastic training job to the current DAG; returns its task.

    ``task.get_artifact("model")`` is the trained model (for :func:`~edl_argo.hera.evaluate` and
    :func:`~edl_argo.hera.predict`), ``task.get_parameter("metrics")`` its final metrics (JSON).
    ``template_ref``: reference the installed WorkflowTemplate instead of embedding the template.

    Besides the master pod's own resources and deadline, its keyword arguments are the settings of
    ``edl-argo train`` (:mod:`edl_argo.settings.table`), named like their flags: ``use_async=True``,
    ``shuffle=False``, ``toleration=["gpu:NoSchedule"]``; each is an input parameter of the template
    (``use-async``) passed as the flag (``--use-async``). Not exposed: what the step sets itself
    (``--backend``, ``--output``, ``--metrics-output``, ``--master-port``, ``--metrics-port``
    (:data:`METRICS_PORT`), ``--namespace``: the workflow's), ``--yaml``, which trains nothing, and
    ``--custom-data-reader`` (a model file's ``custom_data_reader`` is used without it).

    The job is named after the workflow and the task (``<workflow>-<task>``) unless ``job_name`` says
    otherwise, so two training tasks of one workflow run two jobs. The task gets an exit hook
    (:func:`elastic_train_cleanup`) that deletes the job's pods, Services and NetworkPolicy once the task
    has ended for good, whatever the outcome.
    """
    values = dict(locals())
    values.update(values.pop("settings"))
    job_name = values["job_name"]
    if job_name == DEFAULT_JOB_NAME:
        values["job_name"] = job_name = f"{{{{workflow.name}}}}-{name}"
    task = ELASTIC_TRAIN.task(name, values, template_ref)
    cleanup = {"job_name": job_name, "image": values["image"]}
    task.hooks = {"exit": ELASTIC_TRAIN_CLEANUP.hook(cleanup, template_ref)}
    return task


def elastic_train_cleanup(
    name: str = CLEANUP_TEMPLATE,
    *,
    job_name: Annotated[Text, JobName] = DEFAULT_JOB_NAME,
    image: Image = IMAGE,
) -> None:
    """The exit hook of an elastic-train task: ``edl-argo cleanup`` of its job (see
    :mod:`edl_argo.pods.cleanup`). :func:`elastic_train` attaches it; this function only declares its
    inputs."""
    raise TypeError("elastic_train_cleanup is the exit hook elastic_train attaches; it is not a task")


def _template(inputs: StepInputs) -> Container:
    return step_container(
        "elastic-train",
        inputs,
        [
            "train",
            "--backend",
            "kubernetes",
            "--output",
            JOB_DIR,
            "--metrics-output",
            METRICS_FILE,
            "--master-port",
            str(MASTER_PORT),
            "--metrics-port",
            str(METRICS_PORT),
        ],
        ports=[
            ContainerPort(name=PORT_NAME, container_port=MASTER_PORT, protocol="TCP"),
            ContainerPort(name=METRICS_PORT_NAME, container_port=METRICS_PORT, protocol="TCP"),
        ],
        outputs=[
            Artifact(name="model", path=MODEL_DIR),
            # Optional: a job that failed before its first upload, or republished a kept model, has none.
            Artifact(name="tensorboard", path=TENSORBOARD_DIR, optional=True),
            Parameter(name="metrics", value_from=ValueFrom(path=METRICS_FILE)),
        ],
        env=[
            *(FieldEnv(name=name, field_path=path) for name, path in POD_FIELDS.items()),
            *(Env(name=name, value=value) for name, value in WORKFLOW_ENV.items()),
            Env(name=MASTER_SECRETS_ENV, value=MASTER_SECRETS_DIR),
        ],
        # Optional: the first master's pod starts before its job's auth Secret exists (it creates it), and a
        # --tls-secret that does not exist is the master's one-line error, not a pod stuck mounting it.
        volumes=[
            SecretVolume(
                name=name,
                secret_name=secret,
                mount_path=f"{MASTER_SECRETS_DIR}/{name}",
                optional=True,
                default_mode=TLS_FILE_MODE,
                read_only=True,
            )
            for name, secret in ((MASTER_AUTH_VOLUME, AUTH_SECRET), (MASTER_TLS_VOLUME, TLS_SECRET))
        ],
        resources=ResourceRequirements(
            requests={"cpu": inputs.ref("master-cpu"), "memory": inputs.ref("master-memory")}
        ),
        labels=dict(MASTER_POD_LABELS),
        annotations=dict(SCRAPE_ANNOTATIONS),
        service_account_name=SERVICE_ACCOUNT,
        priority_class_name=inputs.ref("master-pod-priority"),
        active_deadline_seconds=inputs.ref("active-deadline-seconds"),
        retry_strategy=RetryStrategy(
            limit=MASTER_RETRIES,
            retry_policy=RetryPolicy.always,
            expression=RETRY_WHEN,
            # The deadline bounds the whole step: retries stop once it has passed since the first attempt,
            # and a retried master's pod gets only what is left of it.
            backoff=Backoff(
                duration="30s", factor=IntOrString(2), max_duration=inputs.ref("active-deadline-seconds")
            ),
        ),
    )


ELASTIC_TRAIN = Step("elastic-train", WORKFLOW_TEMPLATE, elastic_train, _template)


def _cleanup_template(inputs: StepInputs) -> Container:
    return step_container(
        CLEANUP_TEMPLATE,
        inputs,
        ["cleanup", "--backend", "kubernetes"],
        service_account_name=SERVICE_ACCOUNT,
        env=[Env(name=name, value=value) for name, value in STEP_ENV.items()],
        resources=ResourceRequirements(requests={"cpu": "100m", "memory": "256Mi"}),
        retry_strategy=RetryStrategy(
            limit=CLEANUP_RETRIES,
            retry_policy=RetryPolicy.always,
            backoff=Backoff(duration="10s", factor=IntOrString(2)),
        ),
    )


ELASTIC_TRAIN_CLEANUP = Step(CLEANUP_TEMPLATE, WORKFLOW_TEMPLATE, elastic_train_cleanup, _cleanup_template)
