"""TEST-ONLY: the stand-in's scheduler as pure functions: nodes with capacity, what pods request, where a
pending pod goes, whom it preempts, and the Priority admission plugin.
:class:`~tests.k8s_stand_in.cluster.Cluster` gathers the views, calls :func:`plan`, and carries the
decisions out.

As kube-scheduler does, for cpu and memory only:

* A pod requests the sum over its containers of ``resources.requests`` (a limit without a request counts as
  the request, as the API server defaults it; init containers, overhead and other resources are ignored).
* A pod fits a node if its requests are at most the node's allocatable minus the requests of the pods bound
  there that have not terminated (a pod being deleted holds its resources until its process is gone) and of
  the pods nominated there of at least its priority (resources reserved for a preemptor).
* Pending pods are tried in scheduling-queue order: higher priority first, then the oldest. A pod goes to its
  nominated node if it fits there, else to the fitting node left least allocated (mean of the cpu and memory
  fractions requested once it is placed), ties by name.
* A pod that fits nowhere and may preempt (``preemptionPolicy`` is not ``Never``) looks for victims among the
  pods of lower priority, node by node (the default postFilter): with every such pod and every pod already
  terminating gone, it must fit; then the most important of them (highest priority, then oldest) are spared
  one by one while it still fits, so the victims are the lowest-priority, newest pods it needs. The node
  chosen has the lowest highest-victim priority, then the lowest sum of priorities, then the fewest victims,
  then the first name. A node where the pods already terminating suffice needs no victims and wins.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from tests.k8s_stand_in.quantities import parse_quantity

#: The resources the scheduler weighs.
RESOURCES = ("cpu", "memory")
#: Amounts of :data:`RESOURCES` (cores, bytes); in a node's allocatable, a resource left out is unlimited.
Amounts = dict[str, Fraction]
TERMINATED_PHASES = ("Succeeded", "Failed")
#: The API server's default ``preemptionPolicy``.
PREEMPT_LOWER_PRIORITY = "PreemptLowerPriority"
NEVER = "Never"
#: kube-scheduler sums victims' priorities shifted by this, so that a negative priority still adds weight.
_PRIORITY_SHIFT = 2**31


@dataclass(frozen=True)
class StandInNode:
    """A node of the stand-in cluster: ``cpu`` and ``memory`` are its capacity, all of it allocatable, as
    Kubernetes quantities (``"4"``, ``"8Gi"``); None: unlimited (the Node object then leaves it out)."""

    name: str
    cpu: str | None = None
    memory: str | None = None

    def __post_init__(self) -> None:
        for quantity in (self.cpu, self.memory):
            if quantity is not None:
                parse_quantity(quantity)

    def manifest(self, address: str) -> dict[str, Any]:
        """The Node object (without uid and timestamps), its pods reachable at ``address``."""
        amounts = {
            name: quantity
            for name, quantity in zip(RESOURCES, (self.cpu, self.memory), strict=True)
            if quantity
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": {"kubernetes.io/hostname": self.name}},
            "spec": {},
            "status": {
                "capacity": dict(amounts),
                "allocatable": dict(amounts),
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                "addresses": [
                    {"type": "InternalIP", "address": address},
                    {"type": "Hostname", "address": self.name},
                ],
            },
        }


def pod_requests(pod: Mapping[str, Any]) -> Amounts:
    """What ``pod`` requests: the sum over its containers of each resource's request, or limit if it has no
    request. ValueError for a quantity that is not one."""
    total = {resource: Fraction(0) for resource in RESOURCES}
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        for resource in RESOURCES:
            quantity = requests.get(resource, limits.get(resource))
            if quantity is not None:
                total[resource] += parse_quantity(quantity)
    return total


def holds_resources(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod`` occupies its node's resources: bound, and not terminated (Succeeded or Failed)."""
    return bool(pod["spec"].get("nodeName")) and pod.get("status", {}).get("phase") not in TERMINATED_PHASES


def allocatable(node: Mapping[str, Any]) -> Amounts:
    """A Node object's allocatable cpu and memory; a resource it does not list is unlimited (left out)."""
    listed = (node.get("status") or {}).get("allocatable") or {}
    return {resource: parse_quantity(listed[resource]) for resource in RESOURCES if resource in listed}


@dataclass(frozen=True)
class PodView:
    """A pod as the scheduler weighs it. ``arrival``: its creation order in the cluster (the queue's tie
    break: the API's timestamps have whole seconds); ``node``: ``spec.nodeName`` ('' while pending)."""

    uid: str
    namespace: str
    name: str
    priority: int
    requests: Amounts
    arrival: int
    node: str = ""
    nominated_node: str = ""
    terminating: bool = False
    may_preempt: bool = True

    @classmethod
    def of(cls, pod: Mapping[str, Any], arrival: int) -> PodView:
        meta, spec = pod["metadata"], pod["spec"]
        return cls(
            uid=meta["uid"],
            namespace=meta["namespace"],
            name=meta["name"],
            priority=int(spec.get("priority") or 0),
            requests=pod_requests(pod),
            arrival=arrival,
            node=spec.get("nodeName") or "",
            nominated_node=(pod.get("status") or {}).get("nominatedNodeName") or "",
            terminating=bool(meta.get("deletionTimestamp")),
            may_preempt=spec.get("preemptionPolicy", PREEMPT_LOWER_PRIORITY) != NEVER,
        )


@dataclass(frozen=True)
class Bind:
    """Put ``pod`` on ``node``."""

    pod: PodView
    node: str


@dataclass(frozen=True)
class Preempt:
    """``pod`` fits nowhere (``message``) but will on ``node`` once ``victims`` are gone: nominate it there
    and delete them (none: pods already terminating there suffice)."""

    pod: PodView
    node: str
    victims: tuple[PodView, ...]
    message: str


@dataclass(frozen=True)
class Unschedulable:
    """``pod`` fits nowhere and preempts nothing; ``message`` as kube-scheduler writes it."""

    pod: PodView
    message: str


Decision = Bind | Preempt | Unschedulable


def queue_order(pod: PodView) -> tuple[int, int]:
    """The scheduling queue's sort key: higher priority first, then the oldest."""
    return (-pod.priority, pod.arrival)


def plan(
    pending: Iterable[PodView], placed: Iterable[PodView], nodes: Iterable[Mapping[str, Any]]
) -> list[Decision]:
    """What to do with each ``pending`` pod, in queue order, given the ``placed`` pods (bound, holding
    resources) and the Node objects; each decision counts in the next ones (a pod bound uses its node)."""
    pending = list(pending)
    state = _Placement(nodes, placed, pending)
    return [state.decide(pod) for pod in sorted(pending, key=queue_order)]


class _Placement:
    """Nodes (by name), the pods on them and those nominated to them, as the decisions of one pass change
    them."""

    def __init__(
        self, nodes: Iterable[Mapping[str, Any]], placed: Iterable[PodView], pending: Iterable[PodView]
    ) -> None:
        self.capacity = dict(sorted((node["metadata"]["name"], allocatable(node)) for node in nodes))
        self.on_node: dict[str, list[PodView]] = {name: [] for name in self.capacity}
        self.nominated: dict[str, list[PodView]] = {name: [] for name in self.capacity}
        for pod in placed:
            self.on_node.setdefault(pod.node, []).append(pod)
        for pod in pending:
            if pod.nominated_node in self.nominated:
                self.nominated[pod.nominated_node].append(pod)

    def decide(self, pod: PodView) -> Decision:
        shortages: Counter[str] = Counter()
        fitting = []
        for node in self.capacity:
            lacking = _lacking(pod.requests, self.free(node, pod))
            shortages.update(f"Insufficient {resource}" for resource in lacking)
            if not lacking:
                fitting.append(node)
        if fitting:
            node = (
                pod.nominated_node
                if pod.nominated_node in fitting
                else min(fitting, key=lambda n: (self._load(n, pod), n))
            )
            self._nominate(pod, "")
            self.on_node[node].append(replace(pod, node=node))
            return Bind(pod, node)
        message = unschedulable_message(len(self.capacity), shortages)
        preemption = self._preemption(pod) if pod.may_preempt else None
        if preemption is None:
            self._nominate(pod, "")
            return Unschedulable(pod, message)
        node, victims = preemption
        terminating = {victim.uid for victim in victims}
        self.on_node[node] = [
            replace(p, terminating=True) if p.uid in terminating else p for p in self.on_node[node]
        ]
        self._nominate(pod, node)
        return Preempt(pod, node, victims, message)

    def free(self, node: str, pod: PodView, *, spare: Iterable[PodView] = ()) -> Amounts:
        """What is left on ``node`` for ``pod``: its allocatable minus the requests of the pods there and of
        the others nominated there with at least ``pod``'s priority; plus what the ``spare`` pods request."""
        reserved = [p for p in self.nominated[node] if p.uid != pod.uid and p.priority >= pod.priority]
        left = dict(self.capacity[node])
        for other in (*self.on_node[node], *reserved):
            _add(left, other.requests, -1)
        for other in spare:
            _add(left, other.requests, 1)
        return left

    def _load(self, node: str, pod: PodView) -> float:
        """The mean fraction of the node's limited resources requested once ``pod`` is there."""
        capacity, left = self.capacity[node], self.free(node, pod)
        fractions = [
            float((capacity[r] - left[r] + pod.requests[r]) / capacity[r]) if capacity[r] else 1.0
            for r in capacity
        ]
        return sum(fractions) / len(fractions) if fractions else 0.0

    def _preemption(self, pod: PodView) -> tuple[str, tuple[PodView, ...]] | None:
        """The node and victims of kube-scheduler's default preemption (see the module), None if none."""
        candidates = []
        for node in self.capacity:
            victims = self._victims_on(node, pod)
            if victims is not None:
                highest = max((v.priority for v in victims), default=-math.inf)
                weight = sum(v.priority + _PRIORITY_SHIFT for v in victims)
                candidates.append(((highest, weight, len(victims), node), node, victims))
        if not candidates:
            return None
        _, node, victims = min(candidates, key=lambda candidate: candidate[0])
        return node, victims

    def _victims_on(self, node: str, pod: PodView) -> tuple[PodView, ...] | None:
        going = [p for p in self.on_node[node] if p.terminating]
        lower = [p for p in self.on_node[node] if not p.terminating and p.priority < pod.priority]
        left = self.free(node, pod, spare=[*going, *lower])
        if _lacking(pod.requests, left):
            return None
        victims = []
        for candidate in sorted(lower, key=lambda p: (-p.priority, p.arrival)):  # the most important first
            if _lacking(pod.requests, _sum(left, candidate.requests, -1)):
                victims.append(candidate)
            else:
                _add(left, candidate.requests, -1)  # spared: it stays
        return tuple(victims)

    def _nominate(self, pod: PodView, node: str) -> None:
        for pods in self.nominated.values():
            pods[:] = [p for p in pods if p.uid != pod.uid]
        if node:
            self.nominated[node].append(pod)


def unschedulable_message(node_count: int, shortages: Mapping[str, int]) -> str:
    """kube-scheduler's PodScheduled=False message: ``0/2 nodes are available: 2 Insufficient cpu.``"""
    if not node_count:
        return "no nodes available to schedule pods"
    details = ", ".join(f"{count} {reason}" for reason, count in sorted(shortages.items()))
    return f"0/{node_count} nodes are available: {details}."


def admitted_priority(
    pod_name: str, class_name: str, classes: Iterable[Mapping[str, Any]], *, require_class: bool
) -> tuple[str, int, str]:
    """What the Priority admission plugin sets on a pod naming PriorityClass ``class_name`` ('' for none):
    ``(priorityClassName, priority, preemptionPolicy)``. No name: the globalDefault class, else priority 0.
    An unknown name is a PermissionError with the API server's message, unless not ``require_class`` (then
    priority 0: the stand-in's lenient default, for tests that create no PriorityClasses)."""
    known = {c["metadata"]["name"]: c for c in classes}
    if not class_name:
        default = next((c for c in known.values() if c.get("globalDefault")), None)
        if default is None:
            return "", 0, PREEMPT_LOWER_PRIORITY
        class_name = default["metadata"]["name"]
    chosen = known.get(class_name)
    if chosen is None:
        if require_class:
            raise PermissionError(
                f'pods "{pod_name}" is forbidden: no PriorityClass with name {class_name} was found'
            )
        return class_name, 0, PREEMPT_LOWER_PRIORITY
    return class_name, int(chosen["value"]), chosen.get("preemptionPolicy") or PREEMPT_LOWER_PRIORITY


def priority_class_problems(
    priority_class: Mapping[str, Any], others: Iterable[Mapping[str, Any]]
) -> list[str]:
    """What the API server refuses in a PriorityClass (empty: valid): a missing or non-integer ``value``, an
    unknown ``preemptionPolicy``, a second ``globalDefault``."""
    problems = []
    value = priority_class.get("value")
    if not isinstance(value, int) or isinstance(value, bool):
        problems.append(f"value: Required value: an integer, not {value!r}")
    policy = priority_class.get("preemptionPolicy", PREEMPT_LOWER_PRIORITY)
    if policy not in (PREEMPT_LOWER_PRIORITY, NEVER):
        problems.append(f'preemptionPolicy: Unsupported value: "{policy}"')
    if priority_class.get("globalDefault"):
        taken = [c["metadata"]["name"] for c in others if c.get("globalDefault")]
        if taken:
            problems.append(f"globalDefault: Invalid value: true: globalDefault is already set by {taken[0]}")
    return problems


def _lacking(requests: Amounts, left: Amounts) -> list[str]:
    """The limited resources of which ``left`` has less than ``requests``."""
    return [resource for resource, amount in left.items() if requests[resource] > amount]


def _add(amounts: Amounts, change: Amounts, sign: int) -> None:
    for resource in amounts:
        amounts[resource] += sign * change[resource]


def _sum(amounts: Amounts, change: Amounts, sign: int) -> Amounts:
    total = dict(amounts)
    _add(total, change, sign)
    return total
