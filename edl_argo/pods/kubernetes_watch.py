"""Watching a job's pods: the watch loop, its resumption, adoption, and what each pod change means.

:class:`PodWatch` runs one thread that watches the job's pods (label selector
``app.kubernetes.io/instance=<job>``), resuming each watch from the last resourceVersion it saw; when the
server answers 410 Gone (the version was compacted) it lists the pods again (:meth:`PodWatch.relist`) and
reports what it missed, pods missing from the list as deleted. Other failures are retried with backoff
(0.2 s doubling to 10 s, or the ``Retry-After`` of a 429 or 503 if longer) until :meth:`PodWatch.stop`.
The watch is all the backend needs to follow its pods: it never polls them (a list is made only at
start-up and after a 410 Gone).

**Adoption.** A listed running or pending pod that no incarnation tracked by the backend accounts for (one
an earlier master of the job started) is tracked like the backend's own; a finished one (an earlier
incarnation) is remembered as stale and left for ``kubectl logs`` until ``adopt()`` or ``close()``.

**Events.** :func:`~edl_argo.pods.kubernetes_status.observe_pod` reads each pod version (the table of pod
states is in :mod:`edl_argo.pods.kubernetes_status`); :func:`transition` decides which event it means for
the incarnation, adding who deleted it: the master (DELETED with the reason given to ``delete()``), or
someone else (DELETED/Preempted after a DisruptionTarget condition, else DELETED/Deleted). A deleted pod's
terminal event comes once its container has stopped (phase Succeeded/Failed, or the object is gone), so a
relaunched PS never races its predecessor for the port or the checkpoint. A pod that failed with an error
gets the tail of its log in its event; a stuck one (which the kubelet would retry forever) is deleted.
Events of finished incarnations (stale uids) are ignored.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client.rest import ApiException

from edl_argo.pods import manifests
from edl_argo.pods.base import PodPhase, PodReason
from edl_argo.pods.kubernetes_api import (
    CONNECTION_ERRORS,
    REQUEST_SECONDS,
    RETRY_FIRST_SECONDS,
    RETRY_MAX_SECONDS,
    JobApi,
    retry_delay,
    retry_fields,
)
from edl_argo.pods.kubernetes_pods import Incarnation, JobPods, log
from edl_argo.pods.kubernetes_status import PodObservation, has_finished, observe_pod

#: Server-side duration of one watch request; the watch then resumes from its last resourceVersion.
WATCH_SECONDS = 240

#: ``delete_pod(name, uid, grace_seconds)``: how the watch deletes a stuck pod.
PodDeleter = Callable[[str, str, float], None]


def transition(pod: Incarnation, seen: PodObservation) -> tuple[PodPhase, str, str] | None:
    """The event (phase, reason, message) that ``seen`` means for ``pod``, if any; marks ``pod`` as having
    reported it. Called with the lock of the pod's :class:`JobPods` held."""
    if seen.phase is None:
        return None
    if seen.phase is PodPhase.PENDING:
        if pod.pending_reported:
            return None
        pod.pending_reported = True
        return PodPhase.PENDING, seen.reason, seen.message
    if seen.phase is PodPhase.RUNNING:
        if pod.running_reported or seen.deleting:
            return None
        pod.running_reported = True
        pod.phase = PodPhase.RUNNING
        return PodPhase.RUNNING, seen.reason, ""
    if pod.delete_reason is not None:
        return PodPhase.DELETED, pod.delete_reason, f"deleted; {seen.message}"
    if seen.deleting and seen.disrupted:
        return PodPhase.DELETED, PodReason.PREEMPTED, f"preempted; {seen.message}"
    if seen.deleting:
        return (
            PodPhase.DELETED,
            PodReason.DELETED,
            f"deleted through the API by someone else; {seen.message}",
        )
    return seen.phase, seen.reason, seen.message


class PodWatch:
    """Turns the changes of the pods in ``pods`` into their events (see the module docstring).

    :meth:`relist` may be called before :meth:`start` (the backend's start-up adopts that way);
    ``delete_pod`` deletes stuck pods.
    """

    def __init__(self, api: JobApi, pods: JobPods, delete_pod: PodDeleter) -> None:
        self._api = api
        self._pods = pods
        self._delete_pod = delete_pod
        self.job_name = pods.job_name
        self._unwatch = threading.Event()  # set once the backend no longer needs the watch
        self._thread: threading.Thread | None = None

    def start(self, resource_version: str | None) -> None:
        """Start the watch thread, watching from ``resource_version`` (None: list first)."""
        self._thread = threading.Thread(
            target=self._watch, args=(resource_version,), name=f"{self.job_name}-watch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """End the watch thread, waiting for it at most :data:`REQUEST_SECONDS`."""
        self._unwatch.set()
        self._api.interrupt_watch()
        if self._thread is not None:
            self._thread.join(REQUEST_SECONDS)

    def relist(self) -> str:
        """List the job's pods, adopt unknown ones and report what changed since they were last seen;
        returns the list's resourceVersion."""
        listed = self._api.list_pods()
        seen: set[str] = set()
        for obj in listed["items"]:
            seen.add(obj["metadata"]["uid"])
            self._adopt(obj)
            self._observe(obj)
        with self._pods.lock:
            vanished = [p for p in self._pods.pods.values() if p.uid and p.uid not in seen and not p.terminal]
        for pod in vanished:
            self._observe({"metadata": {"uid": pod.uid}}, gone=True, record=pod)
        return str(listed["metadata"]["resourceVersion"])

    def _watch(self, resource_version: str | None) -> None:
        """Turn the job's pod changes into events until :meth:`stop` (the watch thread)."""
        backoff = RETRY_FIRST_SECONDS
        while not self._unwatch.is_set():
            try:
                if resource_version is None:
                    resource_version = self.relist()
                    log.info("pods_relisted", job=self.job_name, resource_version=resource_version)
                began = time.monotonic()
                resource_version = self._watch_once(resource_version)
                if time.monotonic() - began < 1.0:  # a server that ends watches at once: do not spin
                    self._unwatch.wait(RETRY_FIRST_SECONDS)
                backoff = RETRY_FIRST_SECONDS
            except ApiException as error:
                if error.status == 410:
                    resource_version = None
                    continue
                self._watch_trouble(error, backoff)
                backoff = min(backoff * 2, RETRY_MAX_SECONDS)
            except (*CONNECTION_ERRORS, ValueError, KeyError) as error:
                self._watch_trouble(error, backoff)
                backoff = min(backoff * 2, RETRY_MAX_SECONDS)

    def _watch_once(self, resource_version: str) -> str | None:
        """One watch request from ``resource_version``; returns where to resume (None: list again)."""
        for event in self._api.watch_pods(resource_version, WATCH_SECONDS):
            if self._unwatch.is_set():
                break
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    log.info("watch_expired", job=self.job_name, resource_version=resource_version)
                    return None
                raise ApiException(status=obj.get("code"), reason=obj.get("message", "watch error"))
            resource_version = obj["metadata"]["resourceVersion"]
            if kind != "BOOKMARK":
                self._observe(obj, gone=kind == "DELETED")
        return resource_version

    def _watch_trouble(self, error: Exception, backoff: float) -> None:
        """Log the watch's failure ``error`` and wait the ``backoff`` (or the server's ``Retry-After``)."""
        if not self._unwatch.is_set():
            delay = retry_delay(error, backoff)
            log.warning("watch_failed", job=self.job_name, **retry_fields(error, delay))
            self._unwatch.wait(delay)

    def _adopt(self, obj: dict[str, Any]) -> None:
        """Track a running pod of the job that no incarnation known to the backend accounts for."""
        meta = obj["metadata"]
        key = manifests.pod_key(meta.get("labels"))
        if key is None or meta.get("deletionTimestamp"):
            return
        pods = self._pods
        with pods.lock:
            if key in pods.pods or pods.is_stale(key, meta["uid"]) or pods.closed:
                return
            if has_finished(obj):
                pods.mark_stale(key, meta["uid"])
                pods.leftovers.append((meta["name"], meta["uid"]))
                return  # a finished incarnation: kept for its logs until adopt() or close
            pods.pods[key] = Incarnation(key[0], key[1], meta["name"], uid=meta["uid"])
        log.info("pod_adopted", job=self.job_name, pod=meta["name"], uid=meta["uid"])

    def _observe(self, obj: dict[str, Any], gone: bool = False, record: Incarnation | None = None) -> None:
        """Report what a new version of a pod object (or its deletion) means for its incarnation."""
        pods = self._pods
        with pods.lock:
            pod = record or self._claimant(obj)
            if pod is None or pod.terminal:
                return
            seen = observe_pod(obj, gone)
            change = transition(pod, seen)
            if change is None:
                return
            phase, reason, message = change
            if not phase.is_terminal:
                pods.queue_event(pod, phase, reason, None, message)
                return
        if phase is PodPhase.FAILED and reason == PodReason.ERROR and not seen.stuck and not gone:
            tail = self._api.pod_log_tail(pod.name)
            if tail:
                message += "; last lines of its log:\n" + "\n".join(tail)
        with pods.lock:
            pods.finish(pod, phase, reason, seen.exit_code, message)
        if seen.stuck and not seen.deleting:  # the kubelet would retry it forever
            self._delete_pod(pod.name, obj["metadata"]["uid"], 1)

    def _claimant(self, obj: dict[str, Any]) -> Incarnation | None:
        """The incarnation ``obj`` belongs to, if the backend tracks it. Called with the lock held."""
        pods = self._pods
        key = manifests.pod_key(obj["metadata"].get("labels"))
        pod = pods.pods.get(key) if key is not None else None
        uid = obj["metadata"]["uid"]
        if pod is None or key is None:
            return None
        if pod.uid is None and not pods.is_stale(key, uid):
            pod.uid = uid  # its first watch event came before the answer to its creation
        return pod if pod.uid == uid else None
