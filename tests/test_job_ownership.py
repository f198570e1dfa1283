"""One job per training step: job names, the step identity on every object, and a master that refuses (and
a clean-up that spares) objects of another step; worker and PS pods that run where the master runs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from edl_argo.errors import ConfigError
from edl_argo.pods import PodRole, PodSpec, find_free_port
from edl_argo.pods.cleanup import clean_up
from edl_argo.pods.kubernetes import API_URL_ENV, KubernetesBackend
from edl_argo.pods.kubernetes_api import JobApi
from edl_argo.pods.kubernetes_config import KubernetesConfig, step_from_env
from edl_argo.pods.manifests import (
    MAX_JOB_NAME,
    STEP_LABEL,
    fit_job_name,
    job_selector,
    network_policy_manifest,
    pod_manifest,
    step_identity,
    validate_job_name,
)
from tests.k8s_helpers import kubernetes_ps_port, role_rules
from tests.k8s_stand_in import KubernetesStandIn

pytestmark = pytest.mark.timeout(120)


def test_a_step_is_the_same_across_its_retries_and_in_its_exit_hook_and_differs_from_others() -> None:
    step = step_identity("uid-1", "digits-x7k2p.elastic-train")
    assert step == step_identity("uid-1", "digits-x7k2p.elastic-train(0)")
    assert step == step_identity("uid-1", "digits-x7k2p.elastic-train(2)")
    assert step == step_identity("uid-1", "digits-x7k2p.elastic-train.onExit")
    assert step == step_identity("uid-1", "digits-x7k2p.elastic-train.onExit(1)")
    assert step != step_identity("uid-1", "digits-x7k2p.train-large")
    assert step != step_identity("uid-2", "digits-x7k2p.elastic-train")  # a workflow of the same name
    assert step_identity("", "x") == step_identity("uid", "") == ""
    assert (
        step_from_env({"EDL_WORKFLOW_UID": "uid-1", "EDL_NODE_NAME": "digits-x7k2p.elastic-train(1)"}) == step
    )


def test_long_job_names_are_shortened_the_same_way_every_time() -> None:
    long = "a-generated-workflow-name-abcde-" + "train-with-a-long-task-name"
    short = fit_job_name(long)
    assert len(short) == MAX_JOB_NAME and short == fit_job_name(long) and validate_job_name(short)
    assert fit_job_name(long + "-2") != short
    assert fit_job_name("digits-x7k2p-elastic-train") == "digits-x7k2p-elastic-train"


def test_every_object_of_a_job_carries_its_step() -> None:
    config = KubernetesConfig(image="img", step="abc123")
    pod = pod_manifest("job", config, PodSpec(PodRole.WORKER, 0, ("edl-argo", "worker")))
    assert pod["metadata"]["labels"][STEP_LABEL] == "abc123"
    assert network_policy_manifest("job", config)["metadata"]["labels"][STEP_LABEL] == "abc123"
    assert job_selector("job", "abc123").endswith(f",{STEP_LABEL}=abc123")
    assert job_selector("job", "").endswith(f",!{STEP_LABEL}")


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubernetesStandIn]:
    with KubernetesStandIn(tmp_path_factory.mktemp("k8s"), echo_logs=False) as server:
        server.enforce_rules(role_rules())
        yield server


def worker_pod(job: str, step: str, pod_id: int = 0) -> dict[str, Any]:
    labels = {
        "app.kubernetes.io/name": "edl-argo",
        "app.kubernetes.io/instance": job,
        "edl-argo/role": "worker",
        "edl-argo/id": str(pod_id),
        STEP_LABEL: step,
    }
    container = {"name": "main", "image": "img", "command": ["sleep", "120"]}
    return {
        "metadata": {"name": f"{job}-worker-{pod_id}", "labels": labels},
        "spec": {"containers": [container]},
    }


def test_a_master_refuses_pods_labelled_for_another_step(
    stand_in: KubernetesStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_URL_ENV, stand_in.url)
    job = f"shared-{uuid.uuid4().hex[:6]}"
    stand_in.create("pods", worker_pod(job, "stepa"))
    try:
        with pytest.raises(ConfigError, match=rf"holds pod/{job}-worker-0 of another step") as refused:
            KubernetesBackend(job, KubernetesConfig(image="img", ps_port=kubernetes_ps_port(), step="stepb"))
        assert "its own job name" in str(refused.value)
        assert stand_in.pod(f"{job}-worker-0") is not None  # neither adopted nor deleted
        deletes = [c for c in stand_in.calls if c.verb == "delete" and c.name.startswith(job)]
        assert deletes == []
    finally:
        stand_in.delete("pods", f"{job}-worker-0")


def test_the_exit_hook_of_one_step_spares_another_steps_job_of_the_same_name(
    stand_in: KubernetesStandIn,
) -> None:
    job = f"shared-{uuid.uuid4().hex[:6]}"
    stand_in.create("pods", worker_pod(job, "stepa", 0))
    stand_in.create("pods", worker_pod(job, "stepb", 1))
    client = stand_in.api_client()
    try:
        mine = JobApi(client, "default", job_selector(job, "stepb"))
        left = clean_up(mine, JobApi(client, "default", job_selector(job)), job, "stepb", 30, f"{job}-auth")
        assert left == []
        assert stand_in.pod(f"{job}-worker-1") is None or stand_in.pod(f"{job}-worker-1")["metadata"].get(
            "deletionTimestamp"
        )
        assert stand_in.pod(f"{job}-worker-0") is not None
        assert not [
            c
            for c in stand_in.calls
            if c.verb == "delete" and c.resource == "networkpolicies" and c.name == f"{job}-grpc"
        ]
    finally:
        stand_in.delete("pods", f"{job}-worker-0")
        client.close()


def test_worker_and_ps_pods_inherit_the_masters_image_pull_secrets_and_keep_their_settings(
    stand_in: KubernetesStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edl_argo.pods.kubernetes_config import RoleSettings, Toleration

    monkeypatch.setenv(API_URL_ENV, stand_in.url)
    master_pod = f"step-{uuid.uuid4().hex[:6]}"
    container = {"name": "main", "image": "Not Runnable", "command": ["edl-argo", "train"]}  # never runs
    spec = {"containers": [container], "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}]}
    stand_in.create("pods", {"metadata": {"name": master_pod}, "spec": spec})
    monkeypatch.setenv("EDL_POD_NAME", master_pod)
    config = KubernetesConfig(
        image="registry.example/private:1",
        ps_port=kubernetes_ps_port(),
        service_account="trainer",
        node_selector={"pool": "gpu"},
        tolerations=(Toleration("gpu", "", "NoSchedule"),),
        worker=RoleSettings(requests={"cpu": "1"}, priority_class="edl-argo-low"),
        ps=RoleSettings(requests={"cpu": "1"}, priority_class="edl-argo-high"),
    )
    job = f"pull-{uuid.uuid4().hex[:6]}"
    backend = KubernetesBackend(job, config)
    try:
        backend.start(PodSpec(PodRole.PS, 0, ("sleep", "60"), port=config.ps_port))
        backend.start(PodSpec(PodRole.WORKER, 0, ("sleep", "60")))
        stand_in.wait_for(lambda: len(stand_in.objects("pods", job_selector(job))) == 2, what="the pods")
        for pod in stand_in.objects("pods", job_selector(job)):
            pod_spec = pod["spec"]
            role = pod["metadata"]["labels"]["edl-argo/role"]
            assert pod_spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}], role
            assert pod_spec["containers"][0]["image"] == "registry.example/private:1"
            assert pod_spec["serviceAccountName"] == "trainer"
            assert pod_spec["nodeSelector"] == {"pool": "gpu"}
            assert pod_spec["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
            assert pod_spec["priorityClassName"] == f"edl-argo-{'high' if role == 'ps' else 'low'}"
        given = KubernetesConfig(image="img", image_pull_secrets=("own",))
        assert pod_manifest("j", given, PodSpec(PodRole.WORKER, 0, ("x",)))["spec"]["imagePullSecrets"] == [
            {"name": "own"}
        ]
    finally:
        backend.close(grace_seconds=1)
        stand_in.delete("pods", master_pod)


# -- transient API errors at start ---------------------------------------------------------------------


def start_backend(url: str, monkeypatch: pytest.MonkeyPatch) -> KubernetesBackend:
    monkeypatch.setenv(API_URL_ENV, url)
    monkeypatch.delenv("EDL_POD_NAME", raising=False)
    return KubernetesBackend(
        f"start-{uuid.uuid4().hex[:6]}", KubernetesConfig(image="img", ps_port=kubernetes_ps_port())
    )


@pytest.mark.parametrize("status", [429, 503])
def test_throttling_and_server_errors_at_start_are_retried(
    stand_in: KubernetesStandIn, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    before = len(stand_in.calls)
    stand_in.fail_requests("list", "pods", status, "slow down", count=2)
    stand_in.fail_requests("list", "services", status, "slow down", count=2)
    stand_in.fail_requests("create", "networkpolicies", status, "slow down", count=2)
    backend = start_backend(stand_in.url, monkeypatch)
    try:
        calls = stand_in.calls[before:]
        for verb, resource in (("list", "pods"), ("list", "services"), ("create", "networkpolicies")):
            statuses = [c.status for c in calls if (c.verb, c.resource) == (verb, resource)]
            assert statuses.count(status) == 2 and statuses[-1] in (200, 201), (resource, statuses)
        assert stand_in.objects("networkpolicies", job_selector(backend.job_name))
    finally:
        backend.close(grace_seconds=1)
        stand_in.clear_failures()


def test_refused_connections_at_start_are_retried_until_the_api_server_is_up(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    port = find_free_port()
    started: list[KubernetesBackend | BaseException] = []

    def start() -> None:
        try:
            started.append(start_backend(f"http://127.0.0.1:{port}", monkeypatch))
        except BaseException as error:  # surfaced below
            started.append(error)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    time.sleep(2.0)  # the API server is down: connections are refused
    assert not started
    with KubernetesStandIn(tmp_path / "k8s", echo_logs=False, port=port) as server:
        thread.join(60)
        (backend,) = started
        assert isinstance(backend, KubernetesBackend), backend
        assert server.objects("networkpolicies", job_selector(backend.job_name))
        backend.close(grace_seconds=1)


def test_a_refusal_at_start_is_a_misconfiguration_and_lasting_trouble_a_failure(
    stand_in: KubernetesStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edl_argo.errors import JobFailedError
    from edl_argo.pods import kubernetes_creation

    stand_in.fail_requests("list", "pods", 403, 'pods is forbidden: User "x" cannot list resource "pods"')
    with pytest.raises(
        ConfigError, match=r"cannot list the job's pods and services in namespace default: 403 .*rbac.yaml"
    ):
        start_backend(stand_in.url, monkeypatch)
    stand_in.fail_requests("list", "services", 404, 'namespaces "nowhere" not found')
    with pytest.raises(
        ConfigError, match=r"cannot list the job's pods and services in namespace default: 404"
    ):
        start_backend(stand_in.url, monkeypatch)
    monkeypatch.setattr(kubernetes_creation, "START_RETRY_SECONDS", 1.5)
    stand_in.fail_requests("list", "pods", 503, "etcd is down", count=1000)
    try:
        with pytest.raises(JobFailedError, match=r"still answers 503 etcd is down after 2 s of retries"):
            start_backend(stand_in.url, monkeypatch)
    finally:
        stand_in.clear_failures()
