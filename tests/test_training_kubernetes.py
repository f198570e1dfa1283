"""End-to-end training jobs with ``--backend kubernetes``, against the stand-in cluster.

The master runs in the test process and reaches the stand-in API server through the official client
(``EDL_KUBERNETES_API``), exactly as it would reach a cluster; the stand-in runs the worker and PS pods it
creates as processes (``edl-argo worker ...``, ``edl-argo ps ...``) and enforces the Role of
``templates/rbac.yaml``. Four digits jobs (~40 s each on two cores): the plain run, a worker deleted
through the API, a preempted worker whose replacement waits for capacity, and a PS deleted.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from edl_argo import cli, log
from edl_argo.master.job import TrainingJob
from edl_argo.master.task_dispatcher import TaskAssignment
from edl_argo.pods import find_free_port
from edl_argo.pods.kubernetes import API_URL_ENV
from edl_argo.pods.kubernetes_config import KubernetesConfig, Owner, RoleSettings
from tests.engine_helpers import (
    DIGITS_ACCURACY_FLOOR,
    DIGITS_MODEL,
    JobThread,
    assert_no_record_lost,
    digits_config,
)
from tests.k8s_helpers import MASTER_RULES, MASTER_USER_AGENT, job_selector, role_rules
from tests.k8s_stand_in import KubernetesStandIn, rules_allow

pytestmark = pytest.mark.timeout(400)

SECRET = {"AWS_ACCESS_KEY_ID": "AKIATESTONLY", "AWS_SECRET_ACCESS_KEY": "test-only-secret-key"}


@pytest.fixture(autouse=True)
def master_logs_to_stderr() -> None:
    log.configure("INFO")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubernetesStandIn]:
    with KubernetesStandIn(tmp_path_factory.mktemp("k8s")) as server:
        server.enforce_rules(role_rules())
        server.create("secrets", {"metadata": {"name": "storage"}, "stringData": SECRET})
        yield server


@pytest.fixture
def make_job(
    cluster: KubernetesStandIn, digits_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., TrainingJob]:
    """A digits job of a new Workflow, whose master talks to the stand-in like an Argo step's would."""
    monkeypatch.setenv(API_URL_ENV, cluster.url)

    def make(**overrides: Any) -> TrainingJob:
        name = f"wf-{uuid.uuid4().hex[:6]}"
        body = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": name}}
        workflow = cluster.create("workflows", body)
        settings = KubernetesConfig(
            image="edl-argo:test",
            worker=RoleSettings({"cpu": "1", "memory": "1Gi"}, {"memory": "2Gi"}, "low"),
            ps=RoleSettings({"cpu": "1", "memory": "1Gi"}, {}, "high"),
            storage_secret="storage",
            workflow_name=name,
            owner=Owner("argoproj.io/v1alpha1", "Workflow", name, workflow["metadata"]["uid"]),
            ps_port=find_free_port(),
            collective_port=find_free_port(),
        )
        config = digits_config(
            digits_data,
            tmp_path / "job",
            job_name=f"digits-{name[3:]}",
            backend="kubernetes",
            kubernetes=settings,
            **overrides,
        )
        return TrainingJob.load(config)

    return make


def pod_phase(cluster: KubernetesStandIn, name: str) -> str:
    return ((cluster.pod(name) or {}).get("status") or {}).get("phase", "")


def running(cluster: KubernetesStandIn, job: str, role: str) -> list[str]:
    pods = cluster.objects("pods", job_selector(job, role))
    return [p["metadata"]["name"] for p in pods if p["status"]["phase"] == "Running"]


def record_workers_served(job: TrainingJob) -> set[int]:
    """Wrap the dispatcher's ``get_task`` (on this instance) to record which workers got a task."""
    served: set[int] = set()
    get_task = job.dispatcher.get_task

    def recording(worker_id: int) -> TaskAssignment:
        assignment = get_task(worker_id)
        if assignment.kind == "task":
            served.add(worker_id)
        return assignment

    job.dispatcher.get_task = recording  # type: ignore[method-assign]
    return served


def assert_job_cleaned_up(cluster: KubernetesStandIn, job: str) -> None:
    assert cluster.objects("pods", job_selector(job)) == []
    assert cluster.objects("services", job_selector(job)) == []
    assert cluster.objects("secrets", job_selector(job)) == []  # the job's credentials go with it


def test_digits_job_trains_on_kubernetes_pods(
    make_job: Callable[..., TrainingJob], cluster: KubernetesStandIn
) -> None:
    job = make_job()
    name = job.config.job_name
    thread = JobThread(job).start()
    thread.wait_until(lambda: len(running(cluster, name, "worker")) == 2, 120, "two worker pods running")
    pods = {p["metadata"]["name"]: p for p in cluster.objects("pods", job_selector(name))}
    assert set(pods) == {f"{name}-ps-0", f"{name}-worker-0", f"{name}-worker-1"}
    workflow = job.config.kubernetes.workflow_name
    for pod in pods.values():
        assert pod["metadata"]["labels"]["workflows.argoproj.io/workflow"] == workflow
        assert [ref["name"] for ref in pod["metadata"]["ownerReferences"]] == [workflow]
        role = pod["metadata"]["labels"]["edl-argo/role"]
        assert pod["spec"]["containers"][0]["command"][:2] == ["edl-argo", role]
        assert pod["spec"]["priorityClassName"] == {"worker": "low", "ps": "high"}[role]
        assert not [v for v in SECRET.values() if v in json.dumps(pod)]
        assert job.job_secret.hex() not in json.dumps(pod)  # the job's credentials come by secretKeyRef
    metrics = thread.join(300)

    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR  # as with the local backend
    assert_no_record_lost(metrics)
    assert metrics["relaunches"]["worker"] == metrics["relaunches"]["ps"] == 0
    assert_job_cleaned_up(cluster, name)
    calls = [c for c in cluster.calls if c.user_agent.startswith(MASTER_USER_AGENT)]
    assert all(rules_allow(role_rules(), c) for c in calls)
    assert {(c.api_group, c.resource, c.verb) for c in calls} <= MASTER_RULES


@pytest.mark.slow  # 40 s; allreduce pods' objects are checked in test_pods_kubernetes, training locally
def test_allreduce_job_trains_on_worker_pods_only(
    make_job: Callable[..., TrainingJob], cluster: KubernetesStandIn
) -> None:
    """AllreduceStrategy on the cluster: no PS pods or Services; workers declare their collective port
    (the one the job's NetworkPolicy opens) and find each other through the master's rendezvous."""
    job = make_job(distribution_strategy="AllreduceStrategy", num_ps=0)
    name = job.config.job_name
    thread = JobThread(job).start()
    thread.wait_until(lambda: len(running(cluster, name, "worker")) == 2, 120, "two worker pods running")
    pods = cluster.objects("pods", job_selector(name))
    assert sorted(p["metadata"]["name"] for p in pods) == [f"{name}-worker-0", f"{name}-worker-1"]
    for pod in pods:
        container = pod["spec"]["containers"][0]
        assert "AllreduceStrategy" in container["command"] and "--ps-addrs" not in container["command"]
        assert [p["containerPort"] for p in container["ports"]] == [job.config.kubernetes.collective_port]
    metrics = thread.join(300)

    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    assert_no_record_lost(metrics)
    assert metrics["allreduce_replicas"]["max_abs_difference"] == 0.0
    assert cluster.objects("services", job_selector(name, "ps")) == []
    assert_job_cleaned_up(cluster, name)


@pytest.mark.slow  # 40 s; deletions are mapped in test_pods_kubernetes, replacement in test_chaos (local)
def test_worker_pod_deleted_through_the_api_is_replaced_and_nothing_is_lost(
    make_job: Callable[..., TrainingJob], cluster: KubernetesStandIn, capfd: pytest.CaptureFixture[str]
) -> None:
    job = make_job()
    name = job.config.job_name
    thread = JobThread(job).start()
    thread.wait_until(lambda: thread.progress_fraction() >= 0.3, 240, "30% of the tasks")
    with cluster.api_client() as api:  # as the cluster does when it preempts a pod, or kubectl delete
        k8s.CoreV1Api(api).delete_namespaced_pod(f"{name}-worker-0", "default")
    metrics = thread.join(300)

    assert metrics["relaunches"]["worker"] >= 1
    first = metrics["relaunches"]["events"][0]
    assert (first["old_id"], first["new_id"], first["reason"]) == (0, 2, "Deleted")
    assert any(c.verb == "create" and c.resource == "pods" and c.name == "" for c in cluster.calls)
    assert_no_record_lost(metrics)
    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    assert "worker_relaunched old_worker=0 new_worker=2 reason=Deleted" in capfd.readouterr().err
    assert_job_cleaned_up(cluster, name)


def test_preempted_worker_replacement_waits_for_capacity_while_the_job_goes_on(
    make_job: Callable[..., TrainingJob], cluster: KubernetesStandIn, capfd: pytest.CaptureFixture[str]
) -> None:
    job = make_job()
    name = job.config.job_name
    served = record_workers_served(job)
    thread = JobThread(job).start()
    thread.wait_until(lambda: thread.progress_fraction() >= 0.1, 240, "10% of the tasks")
    cluster.hold_pending(job_selector(name, "worker"))  # no capacity left for workers
    try:
        cluster.evict(f"{name}-worker-1")
        replacement = f"{name}-worker-2"
        thread.wait_until(lambda: cluster.pod(replacement) is not None, 60, "the replacement pod")
        before = thread.progress_fraction()
        thread.wait_until(lambda: thread.progress_fraction() >= before + 0.1, 240, "progress with one worker")
        assert pod_phase(cluster, replacement) == "Pending" and 2 not in served
        # The survivor is paused while capacity returns, so that the job cannot end before the replacement
        # (a TensorFlow process starting on a loaded machine) takes a task; its held tasks time out.
        survivor = f"{name}-worker-0"
        cluster.kill(survivor, signal.SIGSTOP)
        try:
            cluster.release()
            thread.wait_until(lambda: 2 in served, 120, "the replacement to take tasks")
        finally:
            cluster.kill(survivor, signal.SIGCONT)
    finally:
        cluster.release()
    metrics = thread.join(300)

    assert metrics["relaunches"]["events"][0]["reason"] == "Preempted"
    assert_no_record_lost(metrics)
    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    assert "pod_phase pod=worker-2 phase=Pending reason=Unschedulable" in capfd.readouterr().err
    assert_job_cleaned_up(cluster, name)


@pytest.mark.slow  # 55 s; relaunch at the same address is in test_pods_kubernetes, restore in test_chaos
def test_ps_pod_deleted_is_recreated_with_its_address_and_restores(
    make_job: Callable[..., TrainingJob], cluster: KubernetesStandIn, capfd: pytest.CaptureFixture[str]
) -> None:
    job = make_job(checkpoint_steps=10)
    name = job.config.job_name
    thread = JobThread(job).start()
    thread.wait_until(lambda: thread.progress_fraction() >= 0.4, 240, "40% of the tasks")
    service = cluster.objects("services", job_selector(name, "ps"))[0]
    old = cluster.pod(f"{name}-ps-0")
    with cluster.api_client() as api:
        k8s.CoreV1Api(api).delete_namespaced_pod(f"{name}-ps-0", "default")
    thread.wait_until(
        lambda: (cluster.pod(f"{name}-ps-0") or old)["metadata"]["uid"] != old["metadata"]["uid"],
        60,
        "a new PS pod",
    )
    assert cluster.objects("services", job_selector(name, "ps")) == [service]  # same Service, same address
    metrics = thread.join(300)

    assert metrics["relaunches"]["ps"] == 1
    assert_no_record_lost(metrics)
    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    assert "ps_restored" in capfd.readouterr().err
    assert_job_cleaned_up(cluster, name)


def test_yaml_prints_the_manifests_without_touching_anything(
    cluster: KubernetesStandIn, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(API_URL_ENV, cluster.url)
    calls = len(cluster.calls)
    argv = [
        "train", "--model-def", DIGITS_MODEL, "--training-data", "s3://nowhere/train",
        "--output", "/nonexistent",
        "--job-name", "preview", "--backend", "kubernetes", "--image", "edl-argo:1", "--num-ps", "2",
        "--ps-pod-priority", "high", "--storage-secret", "storage", "--yaml",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    kinds = [(d["kind"], d["metadata"]["name"]) for d in documents]
    assert kinds == [
        ("NetworkPolicy", "preview-grpc"),
        ("Service", "preview-ps-0"),
        ("Pod", "preview-ps-0"),
        ("Service", "preview-ps-1"),
        ("Pod", "preview-ps-1"),
        ("Pod", "preview-worker-0"),
        ("Pod", "preview-worker-1"),
    ]
    worker = documents[-1]["spec"]["containers"][0]["command"]
    assert (
        worker[worker.index("--ps-addrs") + 1]
        == "preview-ps-0.default.svc:2222,preview-ps-1.default.svc:2223"
    )
    assert len(cluster.calls) == calls  # no API call, no data read (the URLs do not exist)


def test_yaml_with_a_master_port_includes_the_master_service_the_workers_reach(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """As the elastic-train step runs the master (``--master-port 2221``): workers get the Service's name."""
    argv = [
        "train", "--model-def", DIGITS_MODEL, "--training-data", "s3://nowhere/train",
        "--output", "/nonexistent", "--job-name", "preview", "--backend", "kubernetes",
        "--image", "edl-argo:1", "--master-port", "2221", "--yaml",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [(d["kind"], d["metadata"]["name"]) for d in documents[:3]] == [
        ("NetworkPolicy", "preview-grpc"),
        ("Service", "preview-master"),
        ("Service", "preview-ps-0"),
    ]
    master = documents[1]["spec"]
    assert master["ports"][0]["port"] == 2221 and master["selector"]["edl-argo/role"] == "master"
    worker = documents[-1]["spec"]["containers"][0]["command"]
    assert worker[worker.index("--master-addr") + 1] == "preview-master.default.svc:2221"
