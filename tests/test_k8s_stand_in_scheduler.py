"""The Kubernetes stand-in's scheduler (issue 32): nodes with capacity, placement by requests,
PriorityClasses, Unschedulable pods and the scheduling queue, preemption, the Deployment controller, and
utilization sampling. Cheap pods only (``sleep``, ``python -c``): what is tested is the stand-in, not
edl-argo."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from components.priority_classes import MANIFESTS as EDL_ARGO_PRIORITY_CLASSES
from tests.k8s_stand_in import KubernetesStandIn
from tests.k8s_stand_in.quantities import parse_quantity
from tests.k8s_stand_in.scheduler import PodView, Preempt, StandInNode, Unschedulable, plan
from tests.k8s_stand_in.utilization import CpuSample, UtilizationRecorder, cpu_utilization

#: Exits on SIGTERM only once the grace period's SIGKILL comes: says TERM, keeps sleeping.
TERM_IGNORING = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: print('TERM', flush=True))\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def pod(
    name: str,
    cpu: str = "1",
    priority_class: str = "",
    *,
    memory: str | None = None,
    limits: dict[str, str] | None = None,
    grace: int = 0,
    command: list[str] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod requesting ``cpu`` (and ``memory``) that sleeps until deleted."""
    requests = {"cpu": cpu} | ({"memory": memory} if memory else {})
    resources: dict[str, Any] = {"requests": requests} if cpu or memory else {}
    if limits:
        resources["limits"] = limits
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace,
        "containers": [
            {
                "name": "main",
                "image": "busybox",
                "command": command or ["sleep", "600"],
                "resources": resources,
            }
        ],
    }
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[KubernetesStandIn]:
    nodes = [StandInNode("node-a", cpu="2", memory="4Gi"), StandInNode("node-b", cpu="2", memory="4Gi")]
    with KubernetesStandIn(tmp_path, echo_logs=False, nodes=nodes) as cluster:
        yield cluster


@pytest.fixture
def one_node(tmp_path: Path) -> Iterator[KubernetesStandIn]:
    """One node of 3 CPUs and PriorityClasses low (1), mid (5), high (10), patient (10, never preempts)."""
    with KubernetesStandIn(tmp_path, echo_logs=False, nodes=[StandInNode("node", cpu="3")]) as cluster:
        for name, value in (("low", 1), ("mid", 5), ("high", 10)):
            cluster.create_priority_class(name, value)
        cluster.create_priority_class("patient", 10, preemption_policy="Never")
        yield cluster


def node_of(cluster: KubernetesStandIn, name: str) -> str:
    """The node pod ``name`` runs on, once it runs."""
    cluster.wait_for(lambda: phase(cluster, name) == "Running", 10, f"{name} running")
    return cluster.pod(name)["spec"]["nodeName"]  # type: ignore[index]


def phase(cluster: KubernetesStandIn, name: str) -> str | None:
    found = cluster.pod(name)
    return found["status"]["phase"] if found else None


def status(cluster: KubernetesStandIn, name: str) -> dict[str, Any]:
    """The status of pod ``name`` (empty if there is no such pod)."""
    return (cluster.pod(name) or {}).get("status", {})


def condition(pod_object: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    return next(
        (c for c in (pod_object or {}).get("status", {}).get("conditions", []) if c["type"] == kind), {}
    )


def unschedulable_message(cluster: KubernetesStandIn, name: str) -> str:
    """The PodScheduled=False/Unschedulable message of pending pod ``name``, once it is written."""
    cluster.wait_for(
        lambda: condition(cluster.pod(name), "PodScheduled").get("reason") == "Unschedulable",
        5,
        f"{name} pending",
    )
    return condition(cluster.pod(name), "PodScheduled")["message"]


def events_of(cluster: KubernetesStandIn, name: str) -> list[tuple[str, dict[str, Any]]]:
    """Every change of pod ``name`` as a watch from the start sees it: (type, object)."""
    return [
        (e.type, e.obj)
        for e in cluster.store.journal
        if e.resource == "pods" and e.obj["metadata"]["name"] == name
    ]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Fraction(1, 2)),
        ("1", Fraction(1)),
        ("2.5", Fraction(5, 2)),
        ("1Gi", Fraction(2**30)),
        ("1024Mi", Fraction(2**30)),
        ("1G", Fraction(10**9)),
        ("128974848", Fraction(128974848)),
        ("129e6", Fraction(129 * 10**6)),
        ("1E", Fraction(10**18)),
        (3, Fraction(3)),
        ("0.1", Fraction(1, 10)),
    ],
)
def test_quantities_are_read_exactly(text: str | int, value: Fraction) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "1.2.3", "one", "1Gb", "1 Gi", "1e", "m"])
def test_malformed_quantities_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_pods_are_placed_by_their_requests_on_the_least_allocated_node(two_nodes: KubernetesStandIn) -> None:
    cluster = two_nodes
    cluster.create("pods", pod("first", "1500m"))
    assert node_of(cluster, "first") == "node-a"  # both empty: the first by name
    cluster.create("pods", pod("second", "500m"))
    assert node_of(cluster, "second") == "node-b"  # node-a would be full
    # A limit without a request counts as the request: 3Gi of memory.
    cluster.create("pods", pod("limited", "", limits={"cpu": "500m", "memory": "3Gi"}))
    assert node_of(cluster, "limited") == "node-b"  # cpu 1/2 and memory 3/4 there, against 2/2 and 3/4
    cluster.create("pods", pod("too-big", "1", memory="2Gi"))  # cpu on node-a, memory on node-b
    assert unschedulable_message(cluster, "too-big") == (
        "0/2 nodes are available: 1 Insufficient cpu, 1 Insufficient memory."
    )
    cluster.create("pods", pod("small", "100m"))
    assert node_of(cluster, "small") == "node-a"
    time.sleep(0.3)  # more scheduling passes: the pending pod's condition is not written again
    assert [kind for kind, _ in events_of(cluster, "too-big")] == ["ADDED", "MODIFIED"]
    assert cluster.pod("too-big")["spec"].get("nodeName") is None  # type: ignore[index]
    assert cluster.pod("small")["status"]["podIP"] == "127.0.0.1"  # type: ignore[index]

    with cluster.api_client() as api:
        nodes = k8s.CoreV1Api(api).list_node().items
        assert [(n.metadata.name, n.status.allocatable) for n in nodes] == [
            ("node-a", {"cpu": "2", "memory": "4Gi"}),
            ("node-b", {"cpu": "2", "memory": "4Gi"}),
        ]
        assert k8s.CoreV1Api(api).read_node("node-b").status.capacity["memory"] == "4Gi"


def test_holds_and_evictions_work_with_capacity_too(two_nodes: KubernetesStandIn) -> None:
    cluster = two_nodes
    cluster.hold_pending("app=held")
    cluster.create("pods", pod("held", "2", labels={"app": "held"}))
    assert "(held by the stand-in)" in unschedulable_message(cluster, "held")
    cluster.create("pods", pod("free", "2"))
    assert node_of(cluster, "free") == "node-a"
    cluster.release()
    assert node_of(cluster, "held") == "node-b"
    cluster.evict("free")
    cluster.wait_for(lambda: cluster.pod("free") is None, 5, "the evicted pod gone")
    evicted = [obj for kind, obj in events_of(cluster, "free") if condition(obj, "DisruptionTarget")]
    assert condition(evicted[0], "DisruptionTarget")["reason"] == "PreemptionByScheduler"


def test_freed_capacity_goes_to_the_pending_pods_by_priority_then_age(one_node: KubernetesStandIn) -> None:
    cluster = one_node
    cluster.create("pods", pod("holder", "3", "high"))
    node_of(cluster, "holder")
    cluster.create("pods", pod("old-mid", "3", "mid"))
    cluster.create("pods", pod("new-high", "3", "high"))  # equal priority to the holder: no preemption
    cluster.create("pods", pod("newer-mid", "3", "mid"))
    for name in ("old-mid", "new-high", "newer-mid"):
        assert unschedulable_message(cluster, name) == "0/1 nodes are available: 1 Insufficient cpu."
    assert not condition(cluster.pod("holder"), "DisruptionTarget")

    freed_at = time.monotonic()
    cluster.delete("pods", "holder")
    assert node_of(cluster, "new-high") == "node"
    assert time.monotonic() - freed_at < 1.0
    assert phase(cluster, "old-mid") == phase(cluster, "newer-mid") == "Pending"
    cluster.delete("pods", "new-high")
    node_of(cluster, "old-mid")
    assert phase(cluster, "newer-mid") == "Pending"


def test_a_higher_priority_pod_preempts_the_lowest_priority_newest_pods_gracefully(
    one_node: KubernetesStandIn, tmp_path: Path
) -> None:
    cluster = one_node
    cluster.create("pods", pod("mid", "1", "mid"))
    cluster.create("pods", pod("low-old", "1", "low"))
    cluster.create("pods", pod("low-new", "1", "low", grace=1, command=[sys.executable, "-c", TERM_IGNORING]))
    for name in ("mid", "low-old", "low-new"):
        node_of(cluster, name)
    # The stand-in reports a pod running before its log-copying thread has created the log file.
    logs = tmp_path / "logs"
    cluster.wait_for(
        lambda: any("ready" in log.read_text() for log in logs.glob("default_low-new_*.log")),
        10,
        "the SIGTERM handler",
    )
    [log] = logs.glob("default_low-new_*.log")

    cluster.create("pods", pod("urgent", "1", "high"))
    cluster.wait_for(
        lambda: status(cluster, "urgent").get("nominatedNodeName") == "node", 5, "the nomination"
    )
    assert status(cluster, "urgent")["phase"] == "Pending"  # until the victim's process is gone
    assert node_of(cluster, "urgent") == "node"

    changes = [(e.time, e.obj) for e in cluster.store.journal if e.obj["metadata"]["name"] == "low-new"]
    preempted_at, preempted = next((t, o) for t, o in changes if condition(o, "DisruptionTarget"))
    assert condition(preempted, "DisruptionTarget") | {"lastTransitionTime": ""} == {
        "type": "DisruptionTarget",
        "status": "True",
        "reason": "PreemptionByScheduler",
        "message": "default-scheduler: preempting to accommodate a higher priority pod",
        "lastTransitionTime": "",
    }
    assert (
        next(o for _, o in changes if o["metadata"].get("deletionTimestamp"))["metadata"][
            "deletionGracePeriodSeconds"
        ]
        == 1
    )  # its terminationGracePeriodSeconds
    terminated_at, terminated = next((t, o) for t, o in changes if o["status"]["phase"] == "Failed")
    assert terminated["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137  # SIGKILL
    assert "TERM" in log.read_text()  # SIGTERM first, ignored ...
    assert terminated_at - preempted_at >= 0.9  # ... so SIGKILL came after the grace period
    assert (
        status(cluster, "mid")["phase"] == status(cluster, "low-old")["phase"] == "Running"
    )  # one was enough


def test_equal_priority_and_preemption_policy_never_preempt_nobody(one_node: KubernetesStandIn) -> None:
    cluster = one_node
    cluster.create("pods", pod("low", "2", "low"))
    cluster.create("pods", pod("high", "1", "high"))
    node_of(cluster, "low")
    node_of(cluster, "high")
    cluster.create("pods", pod("patient", "2", "patient"))  # priority 10, preemptionPolicy Never
    cluster.create("pods", pod("peer", "2", "high"))  # only "low" is lower, and removing it frees enough...
    assert unschedulable_message(cluster, "patient") == "0/1 nodes are available: 1 Insufficient cpu."
    assert node_of(cluster, "peer") == "node"  # ... for "peer", which preempted it
    assert cluster.pod("patient")["spec"]["preemptionPolicy"] == "Never"  # type: ignore[index]
    assert "nominatedNodeName" not in cluster.pod("patient")["status"]  # type: ignore[index]
    cluster.create("pods", pod("another-high", "1", "high"))  # equal priority to everything running
    unschedulable_message(cluster, "another-high")
    time.sleep(0.2)
    assert phase(cluster, "high") == phase(cluster, "peer") == "Running"
    assert not condition(cluster.pod("high"), "DisruptionTarget")


def test_preemption_picks_the_node_with_the_least_important_victims() -> None:
    nodes = [StandInNode(name, cpu="2").manifest("127.0.0.1") for name in ("a", "b")]

    def view(
        name: str, priority: int, node: str = "", arrival: int = 0, cpu: int = 1, **changes: Any
    ) -> PodView:
        requests = {"cpu": Fraction(cpu), "memory": Fraction(0)}
        return PodView(name, "default", name, priority, requests, arrival, node, **changes)

    placed = [
        view("a-mid", 5, "a", 1),
        view("a-low", 1, "a", 2),
        view("b-low-1", 1, "b", 3),
        view("b-low-2", 1, "b", 4),
    ]
    full = "0/2 nodes are available: 2 Insufficient cpu."
    [decision] = plan([view("big", 10, arrival=5, cpu=2)], placed, nodes)  # on a, a-mid would go too
    assert isinstance(decision, Preempt)
    assert (decision.node, [v.name for v in decision.victims]) == ("b", ["b-low-1", "b-low-2"])

    one = view("one", 10, arrival=5)
    [decision] = plan([one], placed, nodes)  # one victim, the newest of the lowest: a-low (a before b)
    assert decision == Preempt(one, "a", (placed[1],), full)

    going = [placed[0], view("a-low", 1, "a", 2, terminating=True), *placed[2:]]
    [decision] = plan([one], going, nodes)  # a pod already terminating frees enough: no new victims
    assert decision == Preempt(one, "a", (), full)

    # The space a terminating pod leaves on a is kept for the pod nominated there, not for a lower one.
    big = view("big", 10, arrival=5, cpu=2, nominated_node="a")
    small = view("small", 3, arrival=6)
    decisions = plan([small, big], [going[1], *placed[2:]], nodes)
    assert decisions[0] == Preempt(big, "a", (), full)
    assert decisions[1] == Preempt(small, "b", (placed[3],), full)

    never = view("never", 10, may_preempt=False)
    assert plan([never], placed, nodes) == [Unschedulable(never, full)]


def test_priority_admission_through_the_kubernetes_client(one_node: KubernetesStandIn) -> None:
    cluster = one_node
    with cluster.api_client() as api:
        core, scheduling = k8s.CoreV1Api(api), k8s.SchedulingV1Api(api)
        for manifest in EDL_ARGO_PRIORITY_CLASSES:  # as the deploy guide applies them
            scheduling.create_priority_class(manifest)
        assert scheduling.read_priority_class("edl-argo-opportunistic").preemption_policy == "Never"
        names = [c.metadata.name for c in scheduling.list_priority_class().items]
        assert {"edl-argo-high", "edl-argo-low", "edl-argo-opportunistic", "low", "high"} <= set(names)

        body = pod("worker", "1", "edl-argo-low")
        created = core.create_namespaced_pod("default", body)
        assert (created.spec.priority, created.spec.preemption_policy) == (-100, "PreemptLowerPriority")
        extra = core.create_namespaced_pod("default", pod("extra", "1", "edl-argo-opportunistic"))
        assert (extra.spec.priority, extra.spec.preemption_policy) == (-200, "Never")

        with pytest.raises(ApiException) as refused:
            core.create_namespaced_pod("default", pod("lost", "1", "no-such-class"))
        assert refused.value.status == 403
        assert (
            '"message": "pods \\"lost\\" is forbidden: no PriorityClass with name no-such-class was found"'
            in (refused.value.body)
        )
        assert core.create_namespaced_pod("default", pod("plain", "0")).spec.priority == 0
        scheduling.create_priority_class(
            k8s.V1PriorityClass(metadata=k8s.V1ObjectMeta(name="usual"), value=7, global_default=True)
        )
        defaulted = core.create_namespaced_pod("default", pod("defaulted", "0")).spec
        assert (defaulted.priority_class_name, defaulted.priority) == ("usual", 7)
        with pytest.raises(ApiException) as second_default:
            scheduling.create_priority_class(
                k8s.V1PriorityClass(metadata=k8s.V1ObjectMeta(name="other"), value=8, global_default=True)
            )
        assert second_default.value.status == 422
        scheduling.delete_priority_class("usual")
        assert core.create_namespaced_pod("default", pod("plain-again", "0")).spec.priority == 0


def test_without_nodes_unknown_priority_classes_are_admitted(tmp_path: Path) -> None:
    with KubernetesStandIn(tmp_path, echo_logs=False) as cluster:
        cluster.create("pods", pod("anything", "64", "not-created"))  # unlimited node
        assert node_of(cluster, "anything") == "stand-in-node"
        assert cluster.pod("anything")["spec"]["priority"] == 0  # type: ignore[index]


def test_a_deployment_scales_and_replaces_its_preempted_pods(one_node: KubernetesStandIn) -> None:
    cluster = one_node

    def replicas(state: str | None = None) -> list[str]:
        pods = cluster.objects("pods", "app=web")
        return sorted(
            p["metadata"]["name"]
            for p in pods
            if not p["metadata"].get("deletionTimestamp") and (state is None or p["status"]["phase"] == state)
        )

    cluster.create_deployment("web", pod("unused", "1", "low")["spec"], replicas=2)
    cluster.wait_for(lambda: replicas("Running") == ["web-0", "web-1"], 10, "2 replicas")
    with cluster.api_client() as api:
        apps = k8s.AppsV1Api(api)
        apps.patch_namespaced_deployment("web", "default", {"spec": {"replicas": 3}})  # strategic merge
        cluster.wait_for(lambda: replicas("Running") == ["web-0", "web-1", "web-2"], 10, "3 replicas")
        cluster.wait_for(
            lambda: apps.read_namespaced_deployment("web", "default").status.ready_replicas == 3, 5
        )

        cluster.create("pods", pod("urgent", "1", "high"))  # the node is full: a replica is preempted...
        assert node_of(cluster, "urgent") == "node"
        preempted = [
            p
            for p in ("web-0", "web-1", "web-2")
            if any(condition(o, "DisruptionTarget") for _, o in events_of(cluster, p))
        ]
        assert preempted == ["web-2"]  # the newest
        cluster.wait_for(
            lambda: len(replicas()) == 3 and "web-3" in replicas(), 5, "a replacement"
        )  # ... and replaced
        assert unschedulable_message(cluster, "web-3") == "0/1 nodes are available: 1 Insufficient cpu."

        cluster.scale_deployment("web", 1)  # the unscheduled pod goes first, then the newest
        cluster.wait_for(lambda: replicas() == ["web-0"], 5, "1 replica")
        assert [kind for kind, _ in events_of(cluster, "web-3")][-1] == "DELETED"
        assert apps.read_namespaced_deployment("web", "default").spec.replicas == 1

        apps.delete_namespaced_deployment("web", "default")  # the pods go with it
        cluster.wait_for(lambda: not cluster.objects("pods", "app=web"), 5, "the replicas gone")


def test_utilization_integrates_the_requests_over_time(one_node: KubernetesStandIn) -> None:
    cluster = one_node
    now = [0.0]
    recorder = UtilizationRecorder(cluster, selectors={"web": "app=web"}, clock=lambda: now[0])
    recorder.sample()  # t=0: nothing runs
    cluster.create("pods", pod("job", "2", "low", labels={"app": "web"}))
    node_of(cluster, "job")
    now[0] = 10.0
    assert recorder.sample().requested == 2  # t=10: 2 of 3 CPUs from now
    cluster.delete("pods", "job")
    cluster.wait_for(lambda: cluster.pod("job") is None, 5, "the job gone")
    now[0] = 15.0
    recorder.sample()  # t=15: nothing runs again
    assert recorder.utilization(0, 20) == pytest.approx(2 * 5 / (3 * 20))
    assert (
        recorder.utilization(10, 15, "web")
        == recorder.utilization(10, 15, "class:low")
        == pytest.approx(2 / 3)
    )
    assert recorder.utilization(10, 15, "class:high") == 0

    with UtilizationRecorder(cluster, interval=0.02) as live:
        time.sleep(0.2)
    assert len(live.samples) >= 3 and all(s.allocatable == 3 for s in live.samples)


def test_the_utilization_integral_on_a_known_timeline() -> None:
    samples = [
        CpuSample(0.0, Fraction(0), Fraction(4), {}),
        CpuSample(1.0, Fraction(2), Fraction(4), {"a": Fraction(2)}),
        CpuSample(3.0, Fraction(4), Fraction(8), {"a": Fraction(1)}),  # a node joined
    ]
    # [0,1): 0/4, [1,3): 2/4, [3,4): 4/8 -> (0 + 4 + 4) / (4 + 8 + 8)
    assert cpu_utilization(samples, 0.0, 4.0) == pytest.approx(8 / 20)
    assert cpu_utilization(samples, 2.0, 4.0, "a") == pytest.approx((2 + 1) / (4 + 8))
    with pytest.raises(ValueError):
        cpu_utilization(samples, -1.0, 2.0)


@pytest.mark.timeout(60)
def test_closing_waits_a_bounded_time_for_a_pod_that_does_not_end_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in's close SIGKILLs every pod and waits for each, but not forever: a pod whose processes
    outlive its bound (here its SIGKILL is lost) fails the close with its name instead of hanging the test
    run until pytest-timeout."""
    from tests.k8s_stand_in import cluster as cluster_module

    stand_in = KubernetesStandIn(tmp_path, echo_logs=False)
    stand_in.create("pods", pod("stuck", cpu=""))
    deadline = time.monotonic() + 30
    while phase(stand_in, "stuck") != "Running":
        assert time.monotonic() < deadline, "the pod never ran"
        time.sleep(0.05)
    process = next(iter(stand_in.cluster._containers.values())).process
    monkeypatch.setattr(cluster_module, "_signal_group", lambda pgid, sig: None)
    monkeypatch.setattr(cluster_module, "CLOSE_WAIT_SECONDS", 0.5)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"stuck.*did not end within 0\.5 s"):
            stand_in.close()
        assert time.monotonic() - started < 10
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    stand_in.close()  # nothing left to wait for
