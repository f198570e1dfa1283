"""What a Kubernetes pod object means as a :class:`~edl_argo.pods.base.PodEvent`: pure functions.

:func:`observe_pod` reads one version of a pod (as the API returns it, a dict) into a
:class:`PodObservation`; the backend adds who asked for a deletion. Together (``main`` is the container):

==============================================================  ===================================
pod                                                             event
==============================================================  ===================================
Pending, condition PodScheduled=False reason Unschedulable      PENDING / Unschedulable (once)
Pending, container waiting CreateContainerConfigError,          FAILED / Error (the pod is deleted)
InvalidImageName, ErrImageNeverPull, ImagePullBackOff
Running                                                         RUNNING / Started
Succeeded                                                       SUCCEEDED / Completed
Failed, ``main`` terminated reason OOMKilled                    FAILED / OOMKilled
Failed, exit status 137                                         FAILED / Killed
Failed, status.reason Evicted/Preempted or DisruptionTarget     FAILED / Preempted
Failed otherwise                                                FAILED / Error (+ last log lines)
deleted by the master (deletionTimestamp set, then terminal     DELETED / the reason given to
or gone)                                                        ``KubernetesBackend.delete``
deleted by someone else, with a DisruptionTarget condition      DELETED / Preempted
(scheduler preemption, eviction API)
deleted by someone else otherwise                               DELETED / Deleted
==============================================================  ===================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edl_argo.pods import manifests
from edl_argo.pods.base import PodPhase, PodReason

#: Waiting reasons of a container that will not start without a change to the pod or the cluster.
FATAL_WAITING_REASONS = frozenset(
    {"CreateContainerConfigError", "InvalidImageName", "ErrImageNeverPull", "ImagePullBackOff"}
)
#: ``status.reason`` of a pod the kubelet evicted (node pressure) or that lost its node to preemption.
DISRUPTION_REASONS = frozenset({"Evicted", "Preempted"})


@dataclass(frozen=True)
class PodObservation:
    """What one version of a pod object means for the backend, before asking who deleted it.

    ``phase`` is None when there is nothing to report (Pending on its way, Unknown). A terminal phase
    (SUCCEEDED, FAILED) means the container has stopped, or will never start (``stuck``).
    """

    phase: PodPhase | None
    reason: str
    exit_code: int | None
    message: str
    deleting: bool
    """The pod is being deleted (deletionTimestamp set) or is gone."""
    disrupted: bool
    """The cluster evicted or preempted it."""
    stuck: bool = False
    """FAILED without having run: a container that cannot start (missing Secret, bad image)."""


def has_finished(pod: dict[str, Any]) -> bool:
    """Whether a pod object's phase is Succeeded or Failed: its container has stopped for good."""
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def observe_pod(pod: dict[str, Any], gone: bool = False) -> PodObservation:
    """Read a pod object (as the API returns it); ``gone``: it was deleted (a DELETED watch event)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    disruption = conditions.get("DisruptionTarget", {})
    disrupted = disruption.get("status") == "True" or status.get("reason") in DISRUPTION_REASONS
    deleting = gone or bool(meta.get("deletionTimestamp"))
    container = _main_container_status(status)
    state = container.get("state") or {}
    terminated = state.get("terminated") or {}
    exit_code = terminated.get("exitCode")

    def seen(
        phase: PodPhase | None, reason: str = "", message: str = "", stuck: bool = False
    ) -> PodObservation:
        return PodObservation(phase, reason, exit_code, message, deleting, disrupted, stuck)

    phase = status.get("phase")
    if phase == "Succeeded":
        return seen(PodPhase.SUCCEEDED, PodReason.COMPLETED, "exited with status 0")
    if phase == "Failed":
        if disrupted:
            detail = disruption.get("message") or status.get("message") or status.get("reason", "")
            return seen(PodPhase.FAILED, PodReason.PREEMPTED, f"evicted by the cluster: {detail}")
        if terminated.get("reason") == "OOMKilled":
            limit = _memory_limit(pod)
            return seen(
                PodPhase.FAILED,
                PodReason.OOM_KILLED,
                f"killed for exceeding its memory limit ({limit or 'no limit set'}); OOMKilled",
            )
        if exit_code == 137:
            return seen(PodPhase.FAILED, PodReason.KILLED, "killed by SIGKILL (exit status 137)")
        what = f"exited with status {exit_code}" if exit_code is not None else "failed"
        detail = terminated.get("message") or status.get("message") or ""
        return seen(PodPhase.FAILED, PodReason.ERROR, f"{what}: {detail}" if detail else what)
    if gone:
        return seen(PodPhase.FAILED, PodReason.ERROR, "deleted before its container stopped")
    if phase == "Running":
        return seen(PodPhase.RUNNING, PodReason.STARTED)
    if phase == "Pending":
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in FATAL_WAITING_REASONS:
            message = f"cannot start: {waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
            return seen(PodPhase.FAILED, PodReason.ERROR, message, stuck=True)
        scheduled = conditions.get("PodScheduled", {})
        if scheduled.get("status") == "False" and scheduled.get("reason") == PodReason.UNSCHEDULABLE:
            return seen(PodPhase.PENDING, PodReason.UNSCHEDULABLE, scheduled.get("message", ""))
    return seen(None)


def _main_container_status(status: dict[str, Any]) -> dict[str, Any]:
    statuses = status.get("containerStatuses") or []
    named = [s for s in statuses if s.get("name") == manifests.CONTAINER]
    return (named or statuses or [{}])[0]


def _memory_limit(pod: dict[str, Any]) -> str:
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == manifests.CONTAINER:
            return str(((container.get("resources") or {}).get("limits") or {}).get("memory", ""))
    return ""
