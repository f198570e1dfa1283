"""TEST-ONLY: a minimal Deployment controller for the stand-in (``deployments``, apps/v1).

It keeps ``spec.replicas`` active pods (not being deleted, not terminated) made from ``spec.template``: the
pods are named ``<deployment>-<n>`` (``n`` counting up from 0, never reused in the Deployment's life),
carry the template's labels and an owner reference to the Deployment (so deleting it cascades to them). It
adds pods when there are fewer (a pod terminated or deleted by someone else, e.g. preempted, is replaced)
and deletes the surplus when there are more, gracefully, unscheduled pods first, then the newest, as the
ReplicaSet controller ranks them. Terminated pods are left in place, as the ReplicaSet controller leaves
them (to the pod garbage collector). ``status`` holds ``replicas`` (active pods), ``readyReplicas``
(running ones), and a ``ReplicaFailure`` condition while pods cannot be created. There are no
ReplicaSets, rollouts or revisions: a changed template applies to new pods only.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tests.k8s_stand_in.errors import ApiError
from tests.k8s_stand_in.scheduler import TERMINATED_PHASES
from tests.k8s_stand_in.selectors import selects
from tests.k8s_stand_in.store import ObjectKey

if TYPE_CHECKING:
    from tests.k8s_stand_in.cluster import Cluster

Json = dict[str, Any]


def deployment_problems(deployment: Mapping[str, Any]) -> list[str]:
    """What the API server refuses in a Deployment (empty: valid): ``spec.replicas`` not a non-negative
    integer, no ``spec.selector`` or one that does not select the template's labels, a template without
    containers."""
    spec = deployment.get("spec") or {}
    problems = []
    replicas = spec.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        problems.append(f"spec.replicas: Invalid value: {replicas!r}: must be greater than or equal to 0")
    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels")
    selector = spec.get("selector")
    if not selector or not labels:
        problems.append("spec.selector: Required value (and spec.template.metadata.labels)")
    else:
        try:
            if not selects(selector, labels):
                problems.append("spec.template.metadata.labels: Invalid value: `selector` does not match")
        except ValueError as error:
            problems.append(f"spec.selector: Invalid value: {error}")
    if not (template.get("spec") or {}).get("containers"):
        problems.append("spec.template.spec.containers: Required value")
    return problems


def replica_pod(deployment: Mapping[str, Any], name: str) -> Json:
    """The pod named ``name`` that ``deployment`` makes from its template."""
    meta = deployment["metadata"]
    template = deployment["spec"]["template"]
    owner = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    pod_meta = copy.deepcopy(template.get("metadata") or {})
    pod_meta.update(name=name, ownerReferences=[owner])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": copy.deepcopy(template["spec"])}


def is_active(pod: Mapping[str, Any]) -> bool:
    """Whether a Deployment counts ``pod`` as one of its replicas: not being deleted, not terminated."""
    return (
        not pod["metadata"].get("deletionTimestamp") and pod["status"].get("phase") not in TERMINATED_PHASES
    )


class DeploymentController:
    """Reconciles the Deployments of ``cluster`` (see the module); remembers each one's next pod index."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._next_index: dict[str, int] = {}

    def reconcile(self) -> None:
        """Bring every Deployment's pods to its ``spec.replicas`` and its status up to date. Idempotent:
        writes nothing when all is as it should be. Called with the store's lock held."""
        deployments = list(self.cluster.store.items("deployments"))
        live = {deployment["metadata"]["uid"] for _, deployment in deployments}
        self._next_index = {uid: index for uid, index in self._next_index.items() if uid in live}
        for key, deployment in deployments:
            self._reconcile(key, deployment)

    def _reconcile(self, key: ObjectKey, deployment: Json) -> None:
        cluster, namespace, uid = self.cluster, key[1], deployment["metadata"]["uid"]
        pods = dict(cluster.store.items("pods", namespace))
        owned = {
            k: p
            for k, p in pods.items()
            if any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences") or [])
        }
        active = {k: p for k, p in owned.items() if is_active(p)}
        wanted = deployment["spec"].get("replicas", 1)
        failure = ""
        while len(active) < wanted:
            name = self._new_name(key[2], uid, {k[2] for k in pods})
            try:
                created = cluster.create("pods", namespace, replica_pod(deployment, name))
            except ApiError as error:
                failure = error.message
                break
            active[("pods", namespace, name)] = created
        surplus = sorted(
            active.items(),
            key=lambda item: (not item[1]["spec"].get("nodeName"), cluster.creation_order(item[1])),
            reverse=True,
        )[: max(len(active) - wanted, 0)]
        for pod_key, _ in surplus:
            cluster.delete("pods", namespace, pod_key[2])
            del active[pod_key]
        ready = sum(
            1 for pod_key in active if pods.get(pod_key, {}).get("status", {}).get("phase") == "Running"
        )
        status: Json = {"replicas": len(active), "readyReplicas": ready, "availableReplicas": ready}
        if failure:
            status["conditions"] = [
                {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": failure}
            ]
        if deployment.get("status") != status:
            deployment["status"] = status
            cluster.store.put(key, deployment, "MODIFIED")

    def _new_name(self, deployment: str, uid: str, taken: set[str]) -> str:
        """The next pod name ``<deployment>-<n>`` of Deployment ``uid`` that is not ``taken``."""
        index = self._next_index.get(uid, 0)
        while f"{deployment}-{index}" in taken:
            index += 1
        self._next_index[uid] = index + 1
        return f"{deployment}-{index}"
