"""Tests of the Kubernetes pod backend (``edl_argo.pods.kubernetes``), its flags and its manifests.

Pods here are tiny ``python -c`` programs that the stand-in API server (``tests/k8s_stand_in``) runs as
local processes; the backend talks to it with the official client over HTTP, as it would to a cluster.
The whole module runs in well under a minute. End-to-end training jobs are in
``tests/test_training_kubernetes.py``.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from edl_argo.errors import ConfigError, JobFailedError
from edl_argo.master.config import add_train_flags, config_from_args
from edl_argo.master.pod_commands import ps_pod
from edl_argo.pipeline.variables import substitute
from edl_argo.pods import (
    PodEvent,
    PodExistsError,
    PodPhase,
    PodReason,
    PodRole,
    PodSpec,
    find_free_port,
    kubernetes_creation,
)
from edl_argo.pods.kubernetes import API_URL_ENV, KubernetesBackend, render_job_manifests
from edl_argo.pods.kubernetes_config import TENSOR_PORT_OFFSET, KubernetesConfig, Owner
from edl_argo.pods.kubernetes_status import observe_pod
from edl_argo.pods.manifests import (
    MASTER_AUTH_VOLUME,
    MASTER_SECRETS_ENV,
    master_labels,
    pod_manifest,
    service_manifest,
)
from edl_argo.rpc.auth import JobSecret
from tests.k8s_helpers import ARGO_EXECUTOR_RULES, MASTER_RULES, MASTER_USER_AGENT, ROOT, role_rules
from tests.k8s_stand_in import KubernetesStandIn, rules_allow
from tests.k8s_stand_in.selectors import label_problems, selects
from tests.manifests import load_documents

pytestmark = pytest.mark.timeout(120)

WORKER, PS = PodRole.WORKER, PodRole.PS


def py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", textwrap.dedent(code))


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubernetesStandIn]:
    with KubernetesStandIn(tmp_path_factory.mktemp("k8s")) as server:
        server.enforce_rules(role_rules())  # the backend must get by with templates/rbac.yaml
        yield server


@pytest.fixture
def new_backend(
    stand_in: KubernetesStandIn, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., KubernetesBackend]]:
    """Makes backends (each its own job unless ``job`` is given) on the stand-in; closes them after."""
    monkeypatch.setenv(API_URL_ENV, stand_in.url)
    made: list[KubernetesBackend] = []

    def make(job: str = "", **settings: Any) -> KubernetesBackend:
        settings.setdefault("ps_port", find_free_port())
        settings.setdefault("image", "img")
        backend = KubernetesBackend(job or f"t-{uuid.uuid4().hex[:8]}", KubernetesConfig(**settings))
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close(grace_seconds=1)


def collect(
    backend: KubernetesBackend, until: Callable[[list[PodEvent]], bool], timeout: float = 30.0
) -> list[PodEvent]:
    """Events of ``backend`` until ``until(events so far)``."""
    events: list[PodEvent] = []
    deadline = time.monotonic() + timeout
    while not until(events):
        assert time.monotonic() < deadline, f"timed out; events so far: {events}"
        events += backend.events(timeout=0.2)
    return events


def terminal(events: list[PodEvent], role: PodRole, pod_id: int) -> PodEvent | None:
    return next((e for e in events if (e.role, e.pod_id) == (role, pod_id) and e.phase.is_terminal), None)


def has(phase: PodPhase, role: PodRole, pod_id: int) -> Callable[[list[PodEvent]], bool]:
    return lambda events: any(e.phase is phase and (e.role, e.pod_id) == (role, pod_id) for e in events)


def ended(*pods: tuple[PodRole, int]) -> Callable[[list[PodEvent]], bool]:
    return lambda events: all(terminal(events, role, pod_id) for role, pod_id in pods)


def sleeper(pod_id: int, role: PodRole = WORKER, port: int | None = None) -> PodSpec:
    return PodSpec(role, pod_id, py("import time; time.sleep(120)"), port=port)


# ---------------------------------------------------------------------------------------------------
# Flags and manifests (no server)

SECRET_VALUES = {"AWS_ACCESS_KEY_ID": "AKIASECRETVALUE", "AWS_SECRET_ACCESS_KEY": "very/secret+key"}
FLAGS = [
    "--model-def", "m.py", "--training-data", "s3://b/train", "--output", "s3://b/out",
    "--job-name", "mnist", "--backend", "kubernetes", "--image", "registry.example/edl-argo:1.0",
    "--namespace", "ml", "--image-pull-policy", "Always", "--service-account", "trainer",
    "--worker-resource-request", "cpu=2,memory=2048Mi,gpu=1", "--worker-resource-limit", "memory=4Gi",
    "--ps-resource-request", "cpu=1,memory=1Gi", "--ps-resource-limit", "cpu=1,memory=1Gi",
    "--master-resource-request", "cpu=500m", "--worker-pod-priority", "low", "--ps-pod-priority", "high",
    "--node-selector", "pool=ml", "--toleration", "nvidia.com/gpu:NoSchedule", "--toleration", "pool=ml",
    "--volume", "claim_name=data,mount_path=/data",
    "--volume", "claim_name=data,mount_path=/ckpt,sub_path=ckpt,read_only=true",
    "--storage-secret", "s3-creds", "--ps-port", "3000",
]  # fmt: skip


def parse_train(argv: list[str]) -> Any:
    parser = argparse.ArgumentParser()
    add_train_flags(parser)
    return config_from_args(parser.parse_args(argv))


@pytest.fixture
def argo_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The master's environment as the Argo template sets it, with credentials it must not leak."""
    for name, value in {
        **SECRET_VALUES,
        "EDL_WORKFLOW_NAME": "wf-abc",
        "EDL_WORKFLOW_UID": "wf-uid-1",
        "EDL_POD_NAME": "wf-abc-master",
        "EDL_POD_UID": "pod-uid-1",
        "EDL_S3_ENDPOINT": "http://minio.ml:9000",
        "AWS_REGION": "eu-west-1",
    }.items():
        monkeypatch.setenv(name, value)


def test_pods_in_another_namespace_than_their_owner_are_refused(
    argo_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Kubernetes deletes a dependent whose owner is in another namespace: the master refuses --namespace
    other than its own (EDL_NAMESPACE, the downward API's) while it owns its pods by its Workflow or pod."""
    from edl_argo import cli

    monkeypatch.setenv("EDL_NAMESPACE", "argo")  # FLAGS say --namespace ml
    with pytest.raises(ConfigError, match=r"^--namespace ml: .*Workflow wf-abc.* namespace argo") as raised:
        parse_train(FLAGS)
    assert "\n" not in str(raised.value)
    assert cli.main(["train", *FLAGS, "--yaml"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    monkeypatch.setenv("EDL_NAMESPACE", "ml")
    owner = parse_train(FLAGS).kubernetes.owner
    assert owner is not None and owner.name == "wf-abc"
    for name in ("EDL_WORKFLOW_NAME", "EDL_WORKFLOW_UID", "EDL_POD_NAME", "EDL_POD_UID"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("EDL_NAMESPACE", "argo")
    config = parse_train(FLAGS).kubernetes  # no owner: the pods may go anywhere
    assert config.owner is None and config.namespace == "ml"


def test_manifests_are_exactly_as_expected(argo_env: None) -> None:
    config = parse_train(FLAGS).kubernetes
    command = ("edl-argo", "worker", "--worker-id", "3")
    worker = pod_manifest("mnist", config, PodSpec(WORKER, 3, command, env={"EXTRA": "1"}))

    labels = {
        "app.kubernetes.io/name": "edl-argo",
        "app.kubernetes.io/instance": "mnist",
        "edl-argo/role": "worker",
        "edl-argo/id": "3",
        "workflows.argoproj.io/workflow": "wf-abc",
    }
    owner = [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "wf-abc", "uid": "wf-uid-1"}]
    env = [
        {"name": "EXTRA", "value": "1"},
        {"name": "EDL_JOB_NAME", "value": "mnist"},
        {"name": "EDL_POD_ROLE", "value": "worker"},
        {"name": "EDL_POD_ID", "value": "3"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "EDL_S3_ENDPOINT", "value": "http://minio.ml:9000"},
        {"name": "AWS_REGION", "value": "eu-west-1"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "EDL_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "EDL_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "EDL_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        *(
            {"name": key, "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": key, "optional": True}}}
            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
        ),
        {"name": "EDL_AUTH_IDENTITY", "value": "worker-3"},  # its own token and the collective one
        {"name": "EDL_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "mnist-auth", "key": "worker-3"}}},
        {
            "name": "EDL_COLLECTIVE_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "mnist-auth", "key": "collective"}},
        },
    ]
    assert worker == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "mnist-worker-3", "namespace": "ml", "labels": labels, "ownerReferences": owner},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 10,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 1000,
                "runAsGroup": 1000,
                "fsGroup": 1000,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "priorityClassName": "low",
            "serviceAccountName": "trainer",
            "nodeSelector": {"pool": "ml"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "pool", "operator": "Equal", "value": "ml"},
            ],
            "volumes": [{"name": "volume-0", "persistentVolumeClaim": {"claimName": "data"}}],
            "containers": [
                {
                    "name": "main",
                    "image": "registry.example/edl-argo:1.0",
                    "imagePullPolicy": "Always",
                    "command": list(command),
                    "env": env,
                    "resources": {
                        "requests": {"cpu": "2", "memory": "2048Mi", "nvidia.com/gpu": "1"},
                        "limits": {"memory": "4Gi", "nvidia.com/gpu": "1"},
                    },
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [
                        {"name": "volume-0", "mountPath": "/data"},
                        {"name": "volume-0", "mountPath": "/ckpt", "subPath": "ckpt", "readOnly": True},
                    ],
                }
            ],
        },
    }

    ps = pod_manifest("mnist", config, PodSpec(PS, 1, ("edl-argo", "ps"), port=config.ps_port_of(1)))
    assert ps["metadata"]["name"] == "mnist-ps-1"
    assert ps["metadata"]["labels"]["edl-argo/role"] == "ps"
    assert ps["spec"]["priorityClassName"] == "high"
    assert ps["spec"]["terminationGracePeriodSeconds"] == 30
    assert ps["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "1", "memory": "1Gi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    }
    assert ps["spec"]["containers"][0]["ports"] == [
        {"name": "grpc", "containerPort": 3001, "protocol": "TCP"}
    ]
    selector = {k: v for k, v in labels.items() if not k.startswith("workflows.")} | {
        "edl-argo/role": "ps",
        "edl-argo/id": "1",
    }
    assert service_manifest("mnist", config, 1, 3001) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "mnist-ps-1",
            "namespace": "ml",
            "labels": selector | {"workflows.argoproj.io/workflow": "wf-abc"},
            "ownerReferences": owner,
        },
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "grpc", "port": 3001, "targetPort": 3001, "protocol": "TCP"}],
        },
    }

    everything = render_job_manifests("mnist", config, [PodSpec(PS, 0, ("edl-argo", "ps"), port=3000)])
    assert not [value for value in SECRET_VALUES.values() if value in everything]
    assert config.master.requests == {"cpu": "500m"}  # recorded, not applied: Argo creates the master


def test_a_ps_pod_declares_its_tensor_port_its_grpc_port_plus_the_offset(argo_env: None) -> None:
    """On Kubernetes a PS's tensor port is fixed (the job's NetworkPolicy opens it by name): the pod's
    command serves it there and its container declares it as ``tensors``."""
    config = parse_train([*FLAGS, "--ps-port", "3000", "--num-ps", "2"])
    assert config.kubernetes is not None
    spec = ps_pod(config, 1, port=config.kubernetes.ps_port_of(1), master_address="m:1", model_def="m.py")
    assert spec.tensor_port == 3001 + TENSOR_PORT_OFFSET
    assert spec.command[spec.command.index("--tensor-port") + 1] == str(3001 + TENSOR_PORT_OFFSET)
    ports = pod_manifest("mnist", config.kubernetes, spec)["spec"]["containers"][0]["ports"]
    assert ports == [
        {"name": "grpc", "containerPort": 3001, "protocol": "TCP"},
        {"name": "tensors", "containerPort": 3001 + TENSOR_PORT_OFFSET, "protocol": "TCP"},
    ]
    with pytest.raises(
        ConfigError, match=re.escape("--ps-port 65440: the last PS's tensor port would be 65541")
    ):
        parse_train([*FLAGS, "--ps-port", "65440", "--num-ps", "2"])


def test_owner_is_the_workflow_else_the_master_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("EDL_WORKFLOW_NAME", "EDL_WORKFLOW_UID", "EDL_POD_NAME", "EDL_POD_UID"):
        monkeypatch.delenv(name, raising=False)
    argv = FLAGS[: FLAGS.index("--namespace")]
    assert parse_train(argv).kubernetes.owner is None
    monkeypatch.setenv("EDL_POD_NAME", "master-pod")
    monkeypatch.setenv("EDL_POD_UID", "u1")
    config = parse_train(argv).kubernetes
    assert config.owner == Owner("v1", "Pod", "master-pod", "u1")
    assert "workflows.argoproj.io/workflow" not in pod_manifest("j", config, sleeper(0))["metadata"]["labels"]
    monkeypatch.setenv("EDL_WORKFLOW_NAME", "wf")
    with pytest.raises(ConfigError, match="EDL_WORKFLOW_UID"):
        parse_train(argv)


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--image", ""], "--image is required"),
        (["--worker-resource-request", "cpu=two"], "--worker-resource-request: cpu=two is not a quantity"),
        (["--ps-resource-request", "memory"], "--ps-resource-request: 'memory' is not KEY=VALUE"),
        (
            ["--worker-resource-request", "memory=2Gi", "--worker-resource-limit", "memory=1Gi"],
            "below its request",
        ),
        (
            ["--worker-resource-request", "gpu=1", "--worker-resource-limit", "gpu=2"],
            "must equal its request",
        ),
        (["--worker-resource-request", "gpu=0.5"], "must be a whole number"),
        (["--ps-pod-priority", "High_Priority"], "--ps-pod-priority 'High_Priority': not a valid"),
        (["--toleration", "key=value:Sometimes"], "effect 'Sometimes'"),
        (["--volume", "claim_name=data"], "needs claim_name=... and mount_path=..."),
        (["--volume", "claim_name=data,mount_path=rel"], "must be absolute"),
        (["--volume", "claim_name=a,mount_path=/x", "--volume", "claim_name=b,mount_path=/x"], "used twice"),
        (["--node-selector", "a=b,a=c"], "--node-selector: a is given twice"),
        (
            ["--backend", "local", "--yaml"],
            "--yaml prints Kubernetes manifests: it needs --backend kubernetes",
        ),
    ],
)
def test_bad_flags_are_one_line_errors_naming_the_flag(flags: list[str], error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)) as raised:
        parse_train([*FLAGS[: FLAGS.index("--namespace")], *flags])
    assert "\n" not in str(raised.value)


def test_rbac_role_grants_exactly_what_the_master_needs() -> None:
    documents = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "templates" / "rbac.yaml").read_text())}
    assert set(documents) == {"ServiceAccount", "Role", "RoleBinding"}
    granted = {
        (group, resource, verb)
        for rule in documents["Role"]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == MASTER_RULES | ARGO_EXECUTOR_RULES
    binding = documents["RoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "edl-argo-master",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": documents["ServiceAccount"]["metadata"]["name"]}
    ]
    classes = list(yaml.safe_load_all((ROOT / "templates" / "priority-classes.yaml").read_text()))
    # --opportunistic-worker-pod-priority, --worker-pod-priority, --ps-pod-priority: workers preempt only
    # opportunistic workers (nothing else is below them), which preempt nothing.
    opportunistic, low, high = sorted(classes, key=lambda c: c["value"])
    assert opportunistic["metadata"]["name"] == "edl-argo-opportunistic"
    assert opportunistic.get("preemptionPolicy") == "Never"
    assert low.get("preemptionPolicy") != "Never" and high.get("preemptionPolicy") != "Never"


def test_pod_objects_map_to_events() -> None:
    def pod(phase: str, **status: Any) -> dict[str, Any]:
        return {"metadata": {"uid": "u"}, "status": {"phase": phase, **status}}

    def terminated(code: int, reason: str = "Error") -> dict[str, Any]:
        return {
            "containerStatuses": [
                {"name": "main", "state": {"terminated": {"exitCode": code, "reason": reason}}}
            ]
        }

    unschedulable = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}
    disrupted = {
        "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]
    }
    cases = {
        "pending": (pod("Pending"), None, ""),
        "unschedulable": (pod("Pending", **unschedulable), PodPhase.PENDING, PodReason.UNSCHEDULABLE),
        "running": (pod("Running"), PodPhase.RUNNING, PodReason.STARTED),
        "succeeded": (
            pod("Succeeded", **terminated(0, "Completed")),
            PodPhase.SUCCEEDED,
            PodReason.COMPLETED,
        ),
        "oom": (pod("Failed", **terminated(137, "OOMKilled")), PodPhase.FAILED, PodReason.OOM_KILLED),
        "sigkill": (pod("Failed", **terminated(137)), PodPhase.FAILED, PodReason.KILLED),
        "error": (pod("Failed", **terminated(2)), PodPhase.FAILED, PodReason.ERROR),
        "evicted": (
            pod("Failed", reason="Evicted", message="low on memory"),
            PodPhase.FAILED,
            PodReason.PREEMPTED,
        ),
        "preempted": (pod("Failed", **disrupted, **terminated(143)), PodPhase.FAILED, PodReason.PREEMPTED),
        "bad secret": (
            pod(
                "Pending",
                containerStatuses=[
                    {"name": "main", "state": {"waiting": {"reason": "CreateContainerConfigError"}}}
                ],
            ),
            PodPhase.FAILED,
            PodReason.ERROR,
        ),
    }
    for name, (obj, phase, reason) in cases.items():
        seen = observe_pod(obj)
        assert (seen.phase, seen.reason) == (phase, reason), name
    assert observe_pod(pod("Failed", **terminated(137, "OOMKilled"))).message.endswith("OOMKilled")
    assert observe_pod(pod("Running"), gone=True).deleting


# ---------------------------------------------------------------------------------------------------
# The backend against the stand-in


def test_pods_run_and_report_their_ends(
    new_backend: Callable[..., KubernetesBackend], stand_in: KubernetesStandIn
) -> None:
    backend = new_backend()
    backend.start(PodSpec(WORKER, 0, py("print('done')")))
    backend.start(PodSpec(WORKER, 1, py("import sys; print('boom', file=sys.stderr); sys.exit(3)")))
    backend.start(sleeper(2))
    backend.start(sleeper(3))
    events = collect(
        backend, lambda ev: ended((WORKER, 0), (WORKER, 1))(ev) and has(PodPhase.RUNNING, WORKER, 3)(ev)
    )
    assert terminal(events, WORKER, 0).phase is PodPhase.SUCCEEDED
    failed = terminal(events, WORKER, 1)
    assert (failed.phase, failed.reason, failed.exit_code) == (PodPhase.FAILED, PodReason.ERROR, 3)
    assert "boom" in failed.message  # the end of its log
    names = {p.name: p.phase for p in backend.list_pods()}
    assert names["worker-3"] is PodPhase.RUNNING

    stand_in.kill(f"{backend.job_name}-worker-2", signal.SIGKILL)
    stand_in.kill(f"{backend.job_name}-worker-3", signal.SIGKILL, oom=True)
    events += collect(backend, ended((WORKER, 2), (WORKER, 3)))
    assert (terminal(events, WORKER, 2).reason, terminal(events, WORKER, 2).exit_code) == (
        PodReason.KILLED,
        137,
    )
    assert terminal(events, WORKER, 3).reason == PodReason.OOM_KILLED
    for pod_id in range(4):  # one RUNNING at most, before the terminal event
        mine = [e.phase for e in events if e.pod_id == pod_id]
        assert (
            mine[-1].is_terminal
            and mine.count(PodPhase.RUNNING) <= 1
            and sum(p.is_terminal for p in mine) == 1
        )
    assert backend.list_pods() == []


def test_deletions_by_the_master_by_someone_else_and_by_preemption(
    new_backend: Callable[..., KubernetesBackend], stand_in: KubernetesStandIn
) -> None:
    backend = new_backend()
    for pod_id in range(3):
        backend.start(sleeper(pod_id))
    collect(backend, lambda ev: sum(e.phase is PodPhase.RUNNING for e in ev) == 3)
    backend.delete(WORKER, 0, reason="ScaledDown", grace_seconds=1)
    with stand_in.api_client() as api:  # someone else, through the API (kubectl delete pod)
        k8s.CoreV1Api(api).delete_namespaced_pod(
            f"{backend.job_name}-worker-1", "default", grace_period_seconds=1
        )
    stand_in.evict(f"{backend.job_name}-worker-2")
    events = collect(backend, ended((WORKER, 0), (WORKER, 1), (WORKER, 2)))
    got = {
        pod_id: (terminal(events, WORKER, pod_id).phase, terminal(events, WORKER, pod_id).reason)
        for pod_id in range(3)
    }
    assert got == {
        0: (PodPhase.DELETED, "ScaledDown"),
        1: (PodPhase.DELETED, PodReason.DELETED),
        2: (PodPhase.DELETED, PodReason.PREEMPTED),
    }
    assert terminal(events, WORKER, 1).exit_code == 143  # SIGTERM, then the terminal event
    assert stand_in.objects("pods", f"app.kubernetes.io/instance={backend.job_name}") == []


def test_pending_for_capacity_then_runs_when_released(
    new_backend: Callable[..., KubernetesBackend], stand_in: KubernetesStandIn
) -> None:
    backend = new_backend()
    stand_in.hold_pending(f"app.kubernetes.io/instance={backend.job_name}", count=1)
    try:
        backend.start(sleeper(0))
        events = collect(backend, has(PodPhase.PENDING, WORKER, 0))
        assert events[0].reason == PodReason.UNSCHEDULABLE and "Insufficient cpu" in events[0].message
        backend.start(sleeper(1))
        collect(backend, has(PodPhase.RUNNING, WORKER, 1))  # others still run
        assert [p.phase for p in backend.list_pods()] == [PodPhase.PENDING, PodPhase.RUNNING]
    finally:
        stand_in.release()
    collect(backend, has(PodPhase.RUNNING, WORKER, 0))


def test_creation_refusals_are_retried_reported_or_fatal(
    new_backend: Callable[..., KubernetesBackend], stand_in: KubernetesStandIn
) -> None:
    backend = new_backend(pod_creation_timeout=2.0)
    stand_in.fail_requests("create", "pods", 403, 'pods "x" is forbidden: exceeded quota: compute', count=2)
    backend.start(sleeper(0))
    events = collect(backend, has(PodPhase.RUNNING, WORKER, 0))
    assert events[0].phase is PodPhase.PENDING and "exceeded quota" in events[0].message

    stand_in.fail_requests("create", "pods", 403, "exceeded quota: compute", count=1000)
    try:
        backend.start(sleeper(1))
        failed = terminal(collect(backend, ended((WORKER, 1))), WORKER, 1)
    finally:
        stand_in.clear_failures()
    assert (failed.phase, failed.reason) == (PodPhase.FAILED, PodReason.ERROR)
    assert "exceeded quota" in failed.message

    stand_in.fail_requests("create", "pods", 422, "spec.containers[0].image: Required value")
    started = time.monotonic()
    backend.start(sleeper(2))
    invalid = terminal(collect(backend, ended((WORKER, 2))), WORKER, 2)
    assert invalid.phase is PodPhase.FAILED and "Required value" in invalid.message
    assert time.monotonic() - started < 1.5  # not retried: it cannot become valid


def test_secrets_reach_the_pod_env_by_reference_and_a_pod_that_cannot_start_fails(
    new_backend: Callable[..., KubernetesBackend], stand_in: KubernetesStandIn
) -> None:
    secret = f"s3-{uuid.uuid4().hex[:6]}"
    stand_in.create("secrets", {"metadata": {"name": secret}, "stringData": SECRET_VALUES})
    backend = new_backend(storage_secret=secret)
    env = ("AWS_SECRET_ACCESS_KEY", "POD_IP", "EDL_POD_NAME")
    backend.start(PodSpec(WORKER, 0, py(f"import os; print(*(os.environ[k] for k in {env}))")))
    assert terminal(collect(backend, ended((WORKER, 0))), WORKER, 0).phase is PodPhase.SUCCEEDED
    name = f"{backend.job_name}-worker-0"
    assert stand_in.cluster.pod_log("default", name, None).split() == ["very/secret+key", "127.0.0.1", name]

    broken = new_backend(image="Registry/No Such Image")
    broken.start(sleeper(0))
    failed = terminal(collect(broken, ended((WORKER, 0))), WORKER, 0)
    assert (failed.phase, failed.reason) == (PodPhase.FAILED, PodReason.ERROR)
    assert "InvalidImageName" in failed.message
    selector = f"app.kubernetes.io/instance={broken.job_name}"
    stand_in.wait_for(lambda: not stand_in.objects("pods", selector), what="the stuck pod to be deleted")


def test_the_database_password_reaches_workers_only_and_a_missing_secret_is_no_password(
    new_backend: Callable[..., KubernetesBackend], stand_in: KubernetesStandIn
) -> None:
    """``--db-secret``: the workers, which read the data, get its ``password`` as EDL_DB_PASSWORD by
    reference; a PS does not; a Secret that does not exist (a database without a password) starts pods
    without the variable instead of blocking them."""
    secret = f"db-{uuid.uuid4().hex[:6]}"
    stand_in.create("secrets", {"metadata": {"name": secret}, "stringData": {"password": "pw-123"}})
    show = py("import os; print(os.environ.get('EDL_DB_PASSWORD', 'none'))")
    backend = new_backend(db_secret=secret)
    port = backend.config.ps_port_of(0)
    backend.start(PodSpec(WORKER, 0, show))
    backend.start(PodSpec(PS, 0, show, port=port))
    events = collect(backend, ended((WORKER, 0), (PS, 0)))
    assert terminal(events, WORKER, 0).phase is PodPhase.SUCCEEDED
    logs = {
        role: stand_in.cluster.pod_log("default", f"{backend.job_name}-{role}-0", None).split()
        for role in ("worker", "ps")
    }
    assert logs == {"worker": ["pw-123"], "ps": ["none"]}
    for pod in stand_in.objects("pods", f"app.kubernetes.io/instance={backend.job_name}"):
        assert "pw-123" not in json.dumps(pod)  # by reference, never the value
    missing = new_backend(db_secret=f"absent-{uuid.uuid4().hex[:6]}")
    missing.start(PodSpec(WORKER, 0, show))
    assert terminal(collect(missing, ended((WORKER, 0))), WORKER, 0).phase is PodPhase.SUCCEEDED
    assert stand_in.cluster.pod_log("default", f"{missing.job_name}-worker-0", None).split() == ["none"]


def test_ps_is_relaunched_with_the_same_id_and_address(new_backend: Callable[..., KubernetesBackend]) -> None:
    backend = new_backend()
    port = backend.config.ps_port_of(0)
    backend.start(PodSpec(PS, 0, py("import sys; sys.exit(1)"), port=port))
    address = backend.address(PS, 0)
    assert address == f"127.0.0.1:{port}"  # the Service's clusterIP (the stand-in's is loopback)
    with pytest.raises(PodExistsError):
        backend.start(sleeper(0, PS, port))
    assert terminal(collect(backend, ended((PS, 0))), PS, 0).phase is PodPhase.FAILED
    with pytest.raises(ValueError, match="address must not change"):
        backend.start(sleeper(0, PS, port + 1))
    backend.start(sleeper(0, PS, port))  # the failed pod object is still there: removed, then created
    collect(backend, has(PodPhase.RUNNING, PS, 0))
    assert backend.address(PS, 0) == address


def test_watch_resumes_after_expiry_and_relists_after_410(
    new_backend: Callable[..., KubernetesBackend], stand_in: KubernetesStandIn, tmp_path: Path
) -> None:
    flag = tmp_path / "go"
    backend = new_backend()
    backend.start(
        PodSpec(WORKER, 0, py(f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.05)"))
    )
    collect(backend, has(PodPhase.RUNNING, WORKER, 0))

    stand_in.expire_watches(compact=False)  # a plain watch timeout: resumed from its resourceVersion
    backend.start(sleeper(1))
    collect(backend, has(PodPhase.RUNNING, WORKER, 1))

    lists_before = sum(c.verb == "list" and c.resource == "pods" for c in stand_in.calls)
    stand_in.fail_requests("watch", "pods", 503, "apiserver restarting", count=10**6)
    stand_in.expire_watches(compact=False)
    try:
        stand_in.wait_for(
            lambda: any(c.verb == "watch" and c.status == 503 for c in stand_in.calls), what="a refused watch"
        )
        flag.touch()  # worker 0 exits while the backend cannot watch ...
        name = f"{backend.job_name}-worker-0"
        stand_in.wait_for(
            lambda: (stand_in.pod(name) or {}).get("status", {}).get("phase") == "Succeeded", what="exit"
        )
        stand_in.expire_watches(compact=True)  # ... and the history of that is compacted away
    finally:
        stand_in.clear_failures()
    assert terminal(collect(backend, ended((WORKER, 0))), WORKER, 0).phase is PodPhase.SUCCEEDED
    assert sum(c.verb == "list" and c.resource == "pods" for c in stand_in.calls) > lists_before  # relisted


def test_a_new_backend_adopts_the_pods_of_its_predecessor(
    new_backend: Callable[..., KubernetesBackend], stand_in: KubernetesStandIn
) -> None:
    crashed = new_backend()
    port = crashed.config.ps_port_of(0)
    crashed.start(sleeper(0, PS, port))
    crashed.start(sleeper(4))
    crashed.start(PodSpec(WORKER, 5, py("pass")))  # ends before the crash: a finished leftover
    collect(crashed, lambda ev: sum(e.phase is PodPhase.RUNNING for e in ev) == 3 and ended((WORKER, 5))(ev))
    finished = f"{crashed.job_name}-worker-5"
    assert stand_in.pod(finished) is not None

    successor = new_backend(crashed.job_name, ps_port=crashed.config.ps_port)
    running = [("ps-0", PodPhase.RUNNING), ("worker-4", PodPhase.RUNNING)]
    assert [(p.name, p.phase) for p in successor.list_pods()] == running
    assert [(p.name, p.phase) for p in successor.adopt()] == running
    assert successor.adopt() == []  # nothing new
    stand_in.wait_for(lambda: stand_in.pod(finished) is None, what="the finished leftover to be deleted")
    assert successor.address(PS, 0) == crashed.address(PS, 0)
    with pytest.raises(PodExistsError):
        successor.start(sleeper(4))
    successor.delete(WORKER, 4, reason="Leftover", grace_seconds=1)
    gone = terminal(collect(successor, ended((WORKER, 4))), WORKER, 4)
    assert (gone.phase, gone.reason) == (PodPhase.DELETED, "Leftover")
    successor.close(grace_seconds=1)  # deletes what it adopted, and waits
    assert stand_in.objects("pods", f"app.kubernetes.io/instance={crashed.job_name}") == []
    assert stand_in.objects("services", f"app.kubernetes.io/instance={crashed.job_name}") == []


def test_the_master_is_behind_a_service_when_its_pod_carries_the_master_labels(
    new_backend: Callable[..., KubernetesBackend],
    stand_in: KubernetesStandIn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = new_backend()
    job = backend.job_name
    monkeypatch.delenv("EDL_POD_NAME", raising=False)
    assert backend.expose_master("10.1.2.3:5000") == "10.1.2.3:5000"  # not in a pod: its own address
    master_pod = f"{job}-step-1"
    monkeypatch.setenv("EDL_POD_NAME", master_pod)
    container = {"name": "main", "image": "Not Runnable", "command": ["edl-argo", "train"]}  # never runs
    stand_in.create("pods", {"metadata": {"name": master_pod}, "spec": {"containers": [container]}})
    assert backend.expose_master("10.1.2.3:5000") == "10.1.2.3:5000"  # a pod without the labels
    stand_in.delete("pods", master_pod)
    stand_in.wait_for(lambda: stand_in.pod(master_pod) is None, what="the unlabelled pod to go")
    labels = master_labels(job)
    stand_in.create(
        "pods", {"metadata": {"name": master_pod, "labels": labels}, "spec": {"containers": [container]}}
    )
    try:
        address = backend.expose_master("10.1.2.3:5000")
        (service,) = stand_in.objects("services", f"app.kubernetes.io/instance={job},edl-argo/role=master")
        assert service["metadata"]["name"] == f"{job}-master"
        assert service["spec"]["selector"] == labels
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(5000, 5000)]
        assert address == f"{service['spec']['clusterIP']}:5000"

        successor = new_backend(job, ps_port=backend.config.ps_port)  # a master restarted elsewhere
        assert successor.expose_master("10.9.8.7:5000") == address
        assert (
            successor.adopt() == [] and successor.list_pods() == []
        )  # the master's pod is not a pod of the job
        successor.close(grace_seconds=1)
        assert stand_in.pod(master_pod) is not None  # close deletes the job's pods, not its master's
        assert stand_in.objects("services", f"app.kubernetes.io/instance={job}") == []
    finally:
        stand_in.delete("pods", master_pod)


def test_a_job_named_after_argos_longest_workflow_name_reaches_its_master(
    new_backend: Callable[..., KubernetesBackend],
    stand_in: KubernetesStandIn,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A 63-character workflow name (Argo's longest; a CronWorkflow's runs are as long) makes a 77-character
    job name: the master's pod, created by Argo from the rendered template, is a valid pod, and the job's
    NetworkPolicy, its master's Service and its workers select it; the exit hook removes the job."""
    from hera.workflows import DAG, Workflow

    from edl_argo import cli
    from edl_argo.hera import elastic_train
    from tests.argo_steps import argo_pod, training_tasks

    workflow_name = "nightly-" + "x" * 55
    with Workflow(name=workflow_name, entrypoint="main") as workflow, DAG(name="main"):
        elastic_train(model_def="m.py", training_data="s3://d/train")
    ((task, template),) = training_tasks(workflow.to_dict())
    variables = {"workflow.name": workflow_name, "workflow.uid": "uid-1", "workflow.namespace": "default"}
    pod = argo_pod(task, template, variables)
    labels = pod["metadata"]["labels"]
    assert label_problems(labels) == []  # else Argo cannot create it
    monkeypatch.setenv(MASTER_SECRETS_ENV, pod["env"][MASTER_SECRETS_ENV])  # the pod's, as Argo sets it
    config = config_from_args(cli.build_parser().parse_args(pod["argv"][1:]))
    job = config.job_name
    # The pod mounts the job's auth Secret under the name the master gives it (a restarted master reads it
    # there; its Role cannot read Secrets), optional: the first master's pod starts before it exists.
    auth_volume = pod["volumes"][MASTER_AUTH_VOLUME]
    assert (
        auth_volume["secret"]["secretName"]
        == config.kubernetes.auth_secret
        == f"{workflow_name}-elastic-train-auth"
    )
    assert auth_volume["secret"]["optional"] is True
    assert auth_volume["mountPath"] == f"{config.kubernetes.secrets_dir}/{MASTER_AUTH_VOLUME}"
    master_pod = f"{job[:40]}-master-pod"
    monkeypatch.setenv("EDL_POD_NAME", master_pod)
    container = {"name": "main", "image": "Not Runnable", "command": ["edl-argo", "train"]}  # never runs
    stand_in.create(
        "pods", {"metadata": {"name": master_pod, "labels": labels}, "spec": {"containers": [container]}}
    )
    try:
        backend = new_backend(job, auth_secret=config.kubernetes.auth_secret)
        backend.use_job_secret(JobSecret.generate())
        (secret,) = stand_in.objects("secrets", f"app.kubernetes.io/instance={job}")
        assert secret["metadata"]["name"] == auth_volume["secret"]["secretName"]
        backend.start(sleeper(0))
        address = backend.expose_master("10.1.2.3:5000")
        master = (stand_in.pod(master_pod) or {})["metadata"]["labels"]
        worker = (stand_in.pod(f"{job}-worker-0") or {})["metadata"]["labels"]
        (policy,) = stand_in.objects("networkpolicies", f"app.kubernetes.io/instance={job}")
        (service,) = stand_in.objects("services", f"app.kubernetes.io/instance={job},edl-argo/role=master")
        assert address == f"{service['spec']['clusterIP']}:5000"
        assert selects({"matchLabels": service["spec"]["selector"]}, master)
        assert selects(policy["spec"]["podSelector"], master) and selects(
            policy["spec"]["podSelector"], worker
        )
        (rule,) = policy["spec"]["ingress"]
        assert all(selects(peer["podSelector"], worker) for peer in rule["from"])  # workers reach the master
        (default_deny,) = load_documents(ROOT / "templates" / "network-policy.yaml")
        assert selects(default_deny["spec"]["podSelector"], master)

        hook = {p["name"]: p["value"] for p in task["hooks"]["exit"]["arguments"]["parameters"]}
        hook_job = substitute(hook["job-name"], variables, "the exit hook")
        assert (
            cli.main(["cleanup", "--backend", "kubernetes", "--job-name", hook_job, "--timeout", "30"]) == 0
        )
        assert f"job {job}: nothing left" in capsys.readouterr().out
        assert stand_in.objects("pods", f"app.kubernetes.io/instance={job},edl-argo/role=worker") == []
        assert stand_in.objects("secrets", f"app.kubernetes.io/instance={job}") == []
    finally:
        stand_in.delete("pods", master_pod)


def test_deleting_the_workflow_deletes_the_job(
    new_backend: Callable[..., KubernetesBackend], stand_in: KubernetesStandIn
) -> None:
    name = f"wf-{uuid.uuid4().hex[:6]}"
    workflow = stand_in.create(
        "workflows", {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": name}}
    )
    owner = Owner("argoproj.io/v1alpha1", "Workflow", name, workflow["metadata"]["uid"])
    backend = new_backend(owner=owner, workflow_name=name)
    backend.start(sleeper(0, PS, backend.config.ps_port_of(0)))
    backend.start(sleeper(0))
    collect(backend, lambda ev: sum(e.phase is PodPhase.RUNNING for e in ev) == 2)
    selector = f"workflows.argoproj.io/workflow={name}"
    assert len(stand_in.objects("pods", selector)) == 2 and len(stand_in.objects("services", selector)) == 1

    stand_in.delete("workflows", name)
    events = collect(backend, ended((PS, 0), (WORKER, 0)))
    assert {e.reason for e in events if e.phase.is_terminal} == {PodReason.DELETED}
    stand_in.wait_for(
        lambda: not stand_in.objects("pods", selector) and not stand_in.objects("services", selector)
    )


def test_the_backend_uses_no_more_than_the_role_grants(
    new_backend: Callable[..., KubernetesBackend], stand_in: KubernetesStandIn
) -> None:
    """Every call the backends of this module made (the stand-in enforces the Role) was allowed."""
    backend = new_backend()  # every kind of call at least once, even when this test runs alone
    backend.start(PodSpec(PS, 0, py("import sys; sys.exit(1)"), port=backend.config.ps_port_of(0)))
    backend.start(sleeper(0))
    collect(backend, lambda ev: has(PodPhase.RUNNING, WORKER, 0)(ev) and ended((PS, 0))(ev))
    backend.delete(WORKER, 0, grace_seconds=1)
    backend.close(grace_seconds=1)

    rules = role_rules()
    calls = [c for c in stand_in.calls if c.user_agent.startswith(MASTER_USER_AGENT)]
    assert all(rules_allow(rules, c) for c in calls), [c for c in calls if not rules_allow(rules, c)]
    used = {(c.api_group, c.resource, c.verb) for c in calls}
    assert used <= MASTER_RULES
    assert {("", "pods", "watch"), ("", "pods/log", "get"), ("", "services", "create")} <= used
    assert {("networking.k8s.io", "networkpolicies", verb) for verb in ("create", "delete")} <= used


def test_a_refusing_or_unreachable_api_server_and_a_bad_job_name_are_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with KubernetesStandIn(tmp_path) as server:
        server.enforce_rules([])  # a service account without the Role
        monkeypatch.setenv(API_URL_ENV, server.url)
        with pytest.raises(
            ConfigError, match=r"cannot list the job.s pods and services in namespace default"
        ):
            KubernetesBackend("job", KubernetesConfig(image="img"))
        with pytest.raises(ConfigError, match="--job-name 'Job_1'"):
            KubernetesBackend("Job_1", KubernetesConfig(image="img"))
    monkeypatch.setenv(API_URL_ENV, f"http://127.0.0.1:{find_free_port()}")
    # Retried for a few seconds rather than the production START_RETRY_SECONDS: the retries happen all the
    # same, and the test does not wait out a real cluster's budget.
    monkeypatch.setattr(kubernetes_creation, "START_RETRY_SECONDS", 4.0)
    started = time.monotonic()
    with pytest.raises(JobFailedError, match="cannot reach the Kubernetes API"):
        KubernetesBackend("job", KubernetesConfig(image="img"))
    assert time.monotonic() - started >= 1.0  # it was retried, not given up at the first refusal
