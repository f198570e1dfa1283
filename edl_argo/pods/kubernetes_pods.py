"""The Kubernetes backend's record of the job's pods, shared by its creation and its watch; no API calls.

:class:`JobPods` holds, under one lock (:attr:`JobPods.lock`), one :class:`Incarnation` per pod the
backend tracks (started by it or adopted from an earlier master), the uids of finished incarnations of each
pod name (whose late events are ignored and whose names a relaunch may reuse), the finished pods of earlier
masters left for ``kubectl logs``, the PS Services' addresses and ports, and whether the backend is closed.
It queues the :class:`~edl_argo.pods.base.PodEvent` s the master takes: :meth:`JobPods.finish` reports a
pod's terminal event once and only once, and :meth:`JobPods.take` forgets a pod once its terminal event has
been taken, so its ``(role, id)`` can be started again.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from edl_argo.addresses import join_host_port
from edl_argo.log import get_logger
from edl_argo.pods import manifests
from edl_argo.pods.base import PodEvent, PodPhase, PodReason, PodRole, PodSpec, PodStatus
from edl_argo.pods.event_queue import EventQueue

#: The backend's events, under one logger name whichever of its modules reports them.
log = get_logger("edl_argo.pods.kubernetes")

#: How many uids of finished incarnations of one pod name are remembered (to ignore their late events).
STALE_UIDS = 16
#: Longest message of a terminal event (its end is kept).
MESSAGE_MAX_CHARS = 2000

PodKey = tuple[PodRole, int]


@dataclass(eq=False)
class Incarnation:
    """The backend's record of one incarnation of a pod; its mutable fields are guarded by the lock of
    its :class:`JobPods`."""

    role: PodRole
    pod_id: int
    name: str
    spec: PodSpec | None = None
    """None for a pod adopted from an earlier master."""
    uid: str | None = None
    """Set once the API has the object (from the creation's answer or its first watch event)."""
    phase: PodPhase = PodPhase.PENDING
    creating: bool = False
    delete_reason: str | None = None
    running_reported: bool = False
    pending_reported: bool = False
    terminal: bool = False
    """Its terminal event is queued; nothing more is reported for it."""


class JobPods:
    """The pods of job ``job_name`` that one backend tracks, and their queued events (see the module).

    Attributes are guarded by :attr:`lock`; methods say whether they take it or expect it held.
    """

    def __init__(self, job_name: str, namespace: str) -> None:
        self.job_name = job_name
        self.namespace = namespace
        self.lock = threading.Lock()
        self.pods: dict[PodKey, Incarnation] = {}
        self.stale_uids: dict[PodKey, deque[str]] = {}
        self.leftovers: list[tuple[str, str]] = []
        """(name, uid) of finished pods of earlier masters, deleted by ``adopt()`` or ``close()``."""
        self.returned_uids: set[str] = set()
        """Of the adopted pods that ``adopt()`` returned."""
        self.ports: dict[PodKey, int] = {}
        self.addresses: dict[int, str] = {}
        self.closed = False
        self.queue = EventQueue()

    def is_stale(self, key: PodKey, uid: str) -> bool:
        """Whether ``uid`` is a finished incarnation of pod ``key``. Called with the lock held."""
        return uid in self.stale_uids.get(key, ())

    def mark_stale(self, key: PodKey, uid: str) -> None:
        """Remember ``uid`` as a finished incarnation of pod ``key``. Called with the lock held."""
        self.stale_uids.setdefault(key, deque(maxlen=STALE_UIDS)).append(uid)

    def queue_event(
        self, pod: Incarnation, phase: PodPhase, reason: str, exit_code: int | None, message: str
    ) -> None:
        self.queue.put(PodEvent(pod.role, pod.pod_id, phase, exit_code, reason, message, time.time()))

    def report_pending(self, pod: Incarnation, message: str) -> None:
        """Report ``pod`` PENDING/Unschedulable with ``message`` unless it is finished. Takes the lock."""
        with self.lock:
            if not pod.terminal:
                self.queue_event(pod, PodPhase.PENDING, PodReason.UNSCHEDULABLE, None, message)

    def finish(
        self, pod: Incarnation, phase: PodPhase, reason: str, exit_code: int | None, message: str
    ) -> None:
        """Record and report ``pod``'s terminal event, unless it has one. Called with the lock held."""
        if pod.terminal:
            return
        pod.terminal = True
        pod.phase = phase
        report = log.warning if phase is PodPhase.FAILED else log.info
        report(
            "pod_exited",
            job=self.job_name,
            pod=pod.name,
            phase=phase.value,
            reason=reason,
            exit_code=exit_code,
        )
        self.queue_event(pod, phase, reason, exit_code, message[-MESSAGE_MAX_CHARS:])

    def take(self, timeout: float | None) -> list[PodEvent]:
        """The queued events (waiting up to ``timeout``); a pod whose terminal event is among them is
        forgotten, its uid remembered as stale. Takes the lock."""
        events = self.queue.take(timeout)
        with self.lock:
            for event in events:
                if event.phase.is_terminal:
                    key = (event.role, event.pod_id)
                    pod = self.pods.pop(key, None)
                    if pod is not None and pod.uid is not None:
                        self.mark_stale(key, pod.uid)
        return events

    def statuses(self) -> list[PodStatus]:
        """The tracked pods' statuses, by role and id. Takes the lock."""
        with self.lock:
            return [
                PodStatus(role, pod_id, pod.phase)
                for (role, pod_id), pod in sorted(self.pods.items(), key=lambda i: (i[0][0].value, i[0][1]))
            ]

    def all_terminal(self) -> bool:
        with self.lock:
            return all(pod.terminal for pod in self.pods.values())

    def remember_service(self, service: dict[str, Any]) -> str | None:
        """Record a PS Service's address (and port); returns it, or None if it is not a PS's Service.
        Takes the lock."""
        key = manifests.pod_key(service["metadata"].get("labels"))
        if key is None or key[0] is not PodRole.PS:
            return None
        port = int(service["spec"]["ports"][0]["port"])
        host = service["spec"].get("clusterIP") or "None"
        if host == "None":  # headless (not one of ours): its DNS name
            host = f"{service['metadata']['name']}.{self.namespace}.svc"
        with self.lock:
            address = self.addresses[key[1]] = join_host_port(host, port)
            self.ports.setdefault(key, port)
        return address
