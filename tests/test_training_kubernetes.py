"""End-to-end training jobs with ``--backend kubernetes``, against the stand-in cluster.

The master runs in the test process and reaches the stand-in API server through the official client
(``EDL_KUBERNETES_API``), exactly as it would reach a cluster; the stand-in runs the worker and PS pods it
creates as processes (``edl-argo worker ...``, ``edl-argo ps ...``) and enforces the Role of
``templates/rbac.yaml``. Four digits jobs (~40 s each on two cores): the plain run, a worker deleted
through the API, a preempted worker whose replacement waits for capacity, and a PS deleted.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hera.workflows import DAG, Workflow
from kubernetes import client as k8s

from edl_argo import cli, log
from edl_argo.hera import elastic_train
from edl_argo.hera.elastic_train import JOB_DIR, MASTER_PORT, METRICS_PORT
from edl_argo.master.job import TrainingJob
from edl_argo.master.task_dispatcher import TaskAssignment, held_tasks
from edl_argo.pods import find_free_port
from edl_argo.pods.kubernetes import API_URL_ENV
from edl_argo.pods.manifests import (
    INSTANCE_LABEL,
    MASTER_AUTH_VOLUME,
    MASTER_ROLE,
    MASTER_SECRETS_ENV,
    NAME_LABEL,
    ROLE_LABEL,
    WORKFLOW_LABEL,
    kubernetes_job_name,
    master_service_name,
    network_policy_name,
)
from tests.argo_steps import argo_pod, argo_pod_manifest, step_template, training_tasks
from tests.engine_helpers import (
    DIGITS_ACCURACY_FLOOR,
    DIGITS_MODEL,
    JobThread,
    assert_no_record_lost,
    model_dir,
    read_metrics,
)
from tests.k8s_helpers import (
    MASTER_RULES,
    MASTER_USER_AGENT,
    job_selector,
    kubernetes_ps_port,
    role_rules,
    stand_in_digits_config,
)
from tests.k8s_stand_in import KubernetesStandIn, rules_allow
from tests.k8s_stand_in.network_policies import ingress_allowed, isolates
from tests.k8s_stand_in.selectors import service_selects
from tests.manifests import ROOT, load_documents

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
        return TrainingJob.load(stand_in_digits_config(cluster, digits_data, tmp_path / "job", **overrides))

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
    """The job's pods, Services and Secrets are gone; the master's own pod (the Argo step's, which Argo
    keeps until the workflow goes) does not count."""
    pods = cluster.objects("pods", job_selector(job))
    assert [p["metadata"]["name"] for p in pods if p["metadata"]["labels"][ROLE_LABEL] != MASTER_ROLE] == []
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


def test_below_min_workers_training_pauses_without_failing_and_resumes_when_capacity_returns(
    make_job: Callable[..., TrainingJob], cluster: KubernetesStandIn, capfd: pytest.CaptureFixture[str]
) -> None:
    """``--min-workers 2``: a preempted worker whose replacement finds no room pauses training (no training
    task goes out; the tasks held finish) until the replacement runs; then the job ends with nothing lost."""
    job = make_job(min_workers=2)
    name = job.config.job_name
    thread = JobThread(job).start()
    thread.wait_until(lambda: thread.progress_fraction() >= 0.1, 240, "10% of the tasks")
    cluster.hold_pending(job_selector(name, "worker"))  # no capacity left for workers
    try:
        cluster.evict(f"{name}-worker-1")
        thread.wait_until(lambda: job.scaler is not None and job.scaler.paused, 60, "training to pause")
        done_at_pause = job.dispatcher.progress()[0]
        held_at_pause = sum(
            1 for entry in held_tasks(job.dispatcher.snapshot()) if entry["task"]["type"] == "training"
        )
        thread.wait_until(lambda: cluster.pod(f"{name}-worker-2") is not None, 60, "the replacement pod")
        time.sleep(5)  # the survivor asks for tasks in vain meanwhile
        assert job.scaler is not None and job.scaler.paused
        assert job.dispatcher.progress()[0] <= done_at_pause + held_at_pause
        assert pod_phase(cluster, f"{name}-worker-2") == "Pending"
    finally:
        cluster.release()
    metrics = thread.join(300)

    assert metrics["worker_scaling"]["paused_seconds"] >= 5
    assert_no_record_lost(metrics)
    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    err = capfd.readouterr().err
    assert re.search(r"training_paused running=1 pending=[01] min_workers=2", err)
    assert "training_resumed running=2" in err
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


#: The longest Workflow name Argo runs: Argo v4 refuses longer ones ("workflow name ... must not be more
#: than 63 characters long", ``maxCharsInObjectName`` in workflow/validate/validate.go, since the name is a
#: label value of every pod of the workflow), so the issue's 70-character workflow name cannot reach a
#: cluster. The job name made of it is longer: ``<workflow>-elastic-train``, 77 characters.
ARGO_MAX_WORKFLOW_NAME = 63


def _service_for(address: str, services: list[dict[str, Any]]) -> dict[str, Any]:
    """The Service that ``address`` (``<service>.<namespace>.svc:<port>`` or ``<clusterIP>:<port>``, as a
    pod's command names it) reaches: the only one of ``services`` with that name or clusterIP and port."""
    host, _, port = address.rpartition(":")
    found = [
        s
        for s in services
        if host in (f"{s['metadata']['name']}.{s['metadata']['namespace']}.svc", s["spec"]["clusterIP"])
        and int(port) in [p["port"] for p in s["spec"]["ports"]]
    ]
    assert len(found) == 1, (address, [s["metadata"]["name"] for s in found])
    return found[0]


def _target_port(service: dict[str, Any], address: str) -> int:
    """The pod port that ``address``'s port of ``service`` forwards to (its ``targetPort``, a number)."""
    port = int(address.rpartition(":")[2])
    (entry,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    return int(entry.get("targetPort", port))


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_a_job_of_argos_longest_workflow_name_trains_with_its_master_in_the_steps_pod(
    cluster: KubernetesStandIn,
    digits_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A workflow named with Argo's longest name (63 characters; see :data:`ARGO_MAX_WORKFLOW_NAME`) runs
    the elastic-train step of the installed WorkflowTemplate (rendered by the Hera code): its pod is
    created on the stand-in as Argo would create it, with the step's labels exactly, its command line and
    its downward-API environment, and the stand-in runs ``edl-argo train`` in it. The job, named after
    the 77-character ``<workflow>-elastic-train``, trains to the end and publishes its model.

    While it trains, every object is read back through the API: the job's NetworkPolicy selects the master
    pod, every worker and the PS, the default-deny policy of ``templates/`` isolates them all, the master's
    Service selects the master's pod alone, and both policies together admit each worker to the master's
    and the PS's ports at the addresses in its command line (a pod of no job is refused). The master's pod
    keeps the step's labels and gains only the job's instance label, so this fails if the step labels its
    pod with a name the API server refuses (over 63 characters), or if the master names its objects other
    than it labels itself. The step's exit hook, run afterwards, names the same job.

    Test-only deviations: the pod's ``/tmp/edl-job`` (``--output``) is a folder of the test, its fixed
    master and metrics ports free ones (the stand-in's pods share the loopback address), its Secret volumes
    a folder (``EDL_MASTER_SECRETS_DIR``), and it reaches the API at the stand-in's URL
    (``EDL_KUBERNETES_API``).
    """
    workflow_name = ("nightly-digits-" + "x" * ARGO_MAX_WORKFLOW_NAME)[:ARGO_MAX_WORKFLOW_NAME]
    body = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": workflow_name}}
    uid = cluster.create("workflows", body)["metadata"]["uid"]
    variables = {"workflow.name": workflow_name, "workflow.uid": uid, "workflow.namespace": "default"}
    with Workflow(name=workflow_name, entrypoint="main") as workflow, DAG(name="main"):
        elastic_train(
            model_def=DIGITS_MODEL,
            training_data=str(digits_data / "train"),
            validation_data=str(digits_data / "test"),
            num_epochs=4,
            minibatch_size=32,
            num_minibatches_per_task=4,
            ps_port=kubernetes_ps_port(),
            storage_secret="storage",
            template_ref=True,
        )
    ((task, template),) = training_tasks(workflow.to_dict())
    master_pod = f"{workflow_name}-elastic-train-3146129071"  # Argo's <workflow>-<template>-<hash>
    pod = argo_pod_manifest(task, template, variables, master_pod)
    step_labels = dict(pod["metadata"]["labels"])
    container = pod["spec"]["containers"][0]
    requested = _flag(container["command"], "--job-name")
    job = kubernetes_job_name(requested)
    assert (len(workflow_name), len(requested), len(job)) == (63, 77, 50)

    output = tmp_path / "edl-job"
    port = find_free_port()
    command = [arg.replace(JOB_DIR, str(output)) for arg in container["command"]]
    command[command.index("--master-port") + 1] = str(port)
    command[command.index("--metrics-port") + 1] = str(find_free_port())
    assert [p["containerPort"] for p in container["ports"]] == [MASTER_PORT, METRICS_PORT]
    container["ports"][0]["containerPort"] = port
    container["command"] = command
    (auth_volume,) = [v for v in template["volumes"] if v["name"] == MASTER_AUTH_VOLUME]
    secrets = tmp_path / "master-secrets"
    cluster.mount_secret(
        argo_pod(task, template, variables)["volumes"][auth_volume["name"]]["secret"]["secretName"],
        secrets / MASTER_AUTH_VOLUME,
    )
    environment = {e["name"]: e for e in container["env"]}
    environment[MASTER_SECRETS_ENV] = {"name": MASTER_SECRETS_ENV, "value": str(secrets)}
    environment[API_URL_ENV] = {"name": API_URL_ENV, "value": cluster.url}
    environment["EDL_RUN_DIR"] = {"name": "EDL_RUN_DIR", "value": str(tmp_path / "run")}
    container["env"] = list(environment.values())
    cluster.create("pods", pod)
    try:
        job_pods = {f"{job}-worker-0", f"{job}-worker-1", f"{job}-ps-0"}

        def all_running() -> bool:
            phases = {p["metadata"]["name"]: p["status"]["phase"] for p in cluster.objects("pods")}
            if phases.get(master_pod) not in ("Pending", "Running"):
                log_tail = cluster.cluster.pod_log("default", master_pod, 15)
                raise AssertionError(f"the master's pod ended early: {phases}\n{log_tail}")
            return all(phases.get(name) == "Running" for name in job_pods)

        cluster.wait_for(all_running, 180, "the job's worker and PS pods running")
        with cluster.api_client() as api:
            core, networking = k8s.CoreV1Api(api), k8s.NetworkingV1Api(api)
            as_json = api.sanitize_for_serialization
            selector = f"{WORKFLOW_LABEL}={workflow_name}"  # Argo's label, not the job's
            pods = {
                p["metadata"]["name"]: p
                for p in as_json(core.list_namespaced_pod("default", label_selector=selector).items)
            }
            services = as_json(core.list_namespaced_service("default").items)
            policy = as_json(networking.read_namespaced_network_policy(network_policy_name(job), "default"))
            master_service = as_json(core.read_namespaced_service(master_service_name(job), "default"))
        assert set(pods) == job_pods | {master_pod}
        master = pods[master_pod]
        added = {k: v for k, v in master["metadata"]["labels"].items() if step_labels.get(k) != v}
        assert added == {INSTANCE_LABEL: job}  # the step's labels, and the job's name the master gave
        (default_deny,) = load_documents(ROOT / "templates" / "network-policy.yaml")
        default_deny["metadata"]["namespace"] = "default"
        for name, member in pods.items():
            assert isolates(default_deny, member) and isolates(policy, member), name
        assert [
            name for name, p in pods.items() if service_selects(master_service, p["metadata"]["labels"])
        ] == [master_pod]
        other_job = {NAME_LABEL: "edl-argo", INSTANCE_LABEL: "another-job", ROLE_LABEL: "worker"}
        stranger = {"metadata": {"namespace": "default", "labels": other_job}}
        for worker in (pods[f"{job}-worker-0"], pods[f"{job}-worker-1"]):
            worker_command = worker["spec"]["containers"][0]["command"]
            paths = {
                _flag(worker_command, "--master-addr"): master_pod,
                _flag(worker_command, "--ps-addrs"): f"{job}-ps-0",
            }
            for address, expected in paths.items():
                service = _service_for(address, services)
                target = _target_port(service, address)
                selected = [n for n, p in pods.items() if service_selects(service, p["metadata"]["labels"])]
                assert selected == [expected], (address, selected)
                destination = pods[expected]
                allowed = ingress_allowed([default_deny, policy], worker, destination, target)
                assert allowed, (worker["metadata"]["name"], address, expected)
                assert not ingress_allowed([default_deny, policy], stranger, destination, target)
            assert _service_for(_flag(worker_command, "--master-addr"), services) == master_service

        def master_done() -> bool:
            return pod_phase(cluster, master_pod) in ("Succeeded", "Failed")

        cluster.wait_for(master_done, 240, "the master to finish")
        terminated = (cluster.pod(master_pod) or {})["status"]["containerStatuses"][0]["state"]["terminated"]
        assert terminated["exitCode"] == 0, terminated
        assert (model_dir(output) / "saved_model" / "saved_model.pb").is_file()
        metrics = read_metrics(output)
        assert_no_record_lost(metrics)
        assert metrics["final_metrics"]["accuracy"] > 0.5  # it learned (chance: 0.1)
        assert json.loads((output / "final-metrics.json").read_text()) == metrics["final_metrics"]
        assert_job_cleaned_up(cluster, job)
        assert cluster.objects("networkpolicies", job_selector(job)) == []

        hook = task["hooks"]["exit"]
        hook_pod = argo_pod(hook, step_template(hook, {}), variables)
        monkeypatch.setenv(API_URL_ENV, cluster.url)
        for name, value in hook_pod["env"].items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        assert cli.main(hook_pod["argv"][1:]) == 0
        assert f"job {job}: nothing left" in capsys.readouterr().out
    finally:
        cluster.delete("workflows", workflow_name)  # and with it the master's pod, and any left of the job
