"""Pods as Kubernetes pods: the backend of a master that runs as an Argo step (``--backend kubernetes``).

The master talks to the API server with the official ``kubernetes`` client (in-cluster service account,
else ``KUBECONFIG``; ``EDL_KUBERNETES_API=http://host:port`` points it at any API server, for tests),
through :class:`~edl_argo.pods.kubernetes_api.JobApi`: it needs exactly what ``templates/rbac.yaml``
grants, pods and services (create, get, list, watch, delete), pods/log (get), networkpolicies (create,
delete) and secrets (create, get, patch, delete) in its namespace.

**Network.** On construction the backend creates the job's NetworkPolicy
(:func:`~edl_argo.pods.manifests.network_policy_manifest`, owned like the pods): only the job's own pods
reach its gRPC ports. One that exists (made by an earlier master of the job) is kept; :meth:`close`
deletes it with the pods and Services.

**Objects.** :meth:`KubernetesBackend.start` creates a Pod per :class:`~edl_argo.pods.base.PodSpec` (see
:mod:`edl_argo.pods.manifests`) and, for a PS, first a ClusterIP Service of the same name that selects it
by role and id. The Service outlives the PS's relaunches, so :meth:`~KubernetesBackend.address` of a PS is
``<clusterIP>:<port>``: a virtual IP that does not change and needs no DNS, through which workers reach
whichever incarnation of the PS runs. (A headless Service would hand out pod IPs, which change at every
relaunch and which resolvers cache.) PS ``i`` listens on ``KubernetesConfig.ps_port + i``, so PS ports
differ even when pods share a host, as in the tests.

**Creation** runs on a thread per pod, so :meth:`~KubernetesBackend.start` returns at once. It is retried
with exponential backoff (0.2 s doubling to 10 s) for ``pod_creation_timeout`` seconds on quota and
admission refusals (403), throttling (429), server errors (5xx) and lost connections: the first refusal is
reported as a PENDING/``Unschedulable`` event quoting the API's message, running out of time as
FAILED/``Error``. Other refusals (400, 401, 404, 422, an RBAC denial) are FAILED/``Error`` at once: retrying
cannot help. A 409 Conflict means a pod of that name still exists: one being deleted is waited for, a
finished one (a PS's previous incarnation) is deleted with a uid precondition, then creation is retried.

**Events.** One thread watches the job's pods (label selector ``app.kubernetes.io/instance=<job>``),
resuming each watch from the last resourceVersion it saw; when the server answers 410 Gone (the version
was compacted) it lists the pods again and reports what it missed, pods missing from the list as deleted.
:func:`~edl_argo.pods.kubernetes_status.observe_pod` reads each pod version (the table of pod states and
events is in :mod:`edl_argo.pods.kubernetes_status`); the backend adds who deleted it: the master
(DELETED with the reason given to :meth:`~KubernetesBackend.delete`), or someone else (DELETED/Preempted
after a DisruptionTarget condition, else DELETED/Deleted). A deleted pod's terminal event comes once its
container has stopped (phase Succeeded/Failed, or the object is gone), so a relaunched PS never races its
predecessor for the port or the checkpoint.

**Adoption.** On construction the backend lists the job's pods and Services by label: running and
pending pods that an earlier master of the job started (one that crashed and that Argo restarted) are
tracked like its own -- :meth:`~KubernetesBackend.list_pods` lists them, their events arrive (the watch
selects by label, not by creator), :meth:`~KubernetesBackend.delete` and :meth:`~KubernetesBackend.close`
remove them -- and PS addresses come from the existing Services. :meth:`~KubernetesBackend.adopt` returns
them and deletes the finished pods of earlier incarnations (until then they stay, for ``kubectl logs``);
:meth:`~KubernetesBackend.close` deletes every pod and Service of the job and waits until they are gone.

**Credentials.** The job's secret is kept in the Secret ``<job>-auth``
(:func:`~edl_argo.pods.manifests.auth_secret_manifest`, owned like the pods): :meth:`stored_job_secret`
reads it (a restarted master reuses it: the pods it adopts hold credentials derived from it),
:meth:`use_job_secret` creates it, and before a worker's pod is created its own token is added to it under
``worker-<id>`` (a JSON merge patch), which the pod reads through ``secretKeyRef``. :meth:`close` deletes it
with the NetworkPolicy. The master's Role needs ``get``, ``create``, ``patch`` and ``delete`` on Secrets.

**The master's address.** :meth:`~KubernetesBackend.expose_master` puts a ClusterIP Service ``<job>-master``
(:func:`~edl_argo.pods.manifests.master_service_manifest`) in front of the master when its own pod
(``EDL_POD_NAME``) carries :func:`~edl_argo.pods.manifests.master_labels`, as the elastic-train step's pod
does: the Service selects whichever pod of the step runs, so a master that Argo retried in a new pod (with
a new IP) is reached at the same ``<clusterIP>:<port>``. The master's own pod is never listed, watched or
deleted as one of the job's pods (its role is ``master``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from edl_argo.addresses import join_host_port, split_host_port
from edl_argo.errors import ConfigError, JobFailedError
from edl_argo.log import get_logger
from edl_argo.pods import manifests
from edl_argo.pods.base import (
    BackendClosedError,
    PodBackend,
    PodEvent,
    PodPhase,
    PodReason,
    PodRole,
    PodSpec,
    PodStatus,
    admit_start,
    pod_name,
)
from edl_argo.pods.cleanup import delete_job_objects, job_objects, objects_of_other_steps
from edl_argo.pods.event_queue import EventQueue
from edl_argo.pods.kubernetes_api import (
    API_URL_ENV,
    CONNECTION_ERRORS,
    REQUEST_SECONDS,
    RETRY_FIRST_SECONDS,
    RETRY_MAX_SECONDS,
    JobApi,
    Result,
    api_message,
    is_transient,
    load_api_client,
    retry_transient,
)
from edl_argo.pods.kubernetes_config import KubernetesConfig
from edl_argo.pods.kubernetes_status import PodObservation, observe_pod
from edl_argo.rpc.auth import JobSecret, pod_identity

__all__ = ["API_URL_ENV", "KubernetesBackend", "load_api_client", "render_job_manifests"]

log = get_logger(__name__)

#: Server-side duration of one watch request; the watch then resumes from its last resourceVersion.
WATCH_SECONDS = 240
#: How long the constructor retries transient API failures (429, 5xx, no connection) before giving up.
START_RETRY_SECONDS = 120.0
#: How long :meth:`KubernetesBackend.close` waits beyond the grace period for the pods to be gone.
CLOSE_EXTRA_SECONDS = 30.0
#: API statuses worth retrying a creation on (quota, admission, throttling, server trouble).
RETRYABLE_STATUSES = frozenset({403, 429, 500, 502, 503, 504})
#: How many uids of finished incarnations of one pod name are remembered (to ignore their late events).
_STALE_UIDS = 16
_MESSAGE_MAX_CHARS = 2000

_PodKey = tuple[PodRole, int]


def render_job_manifests(
    job_name: str, config: KubernetesConfig, specs: Sequence[PodSpec], *, master_port: int = 0
) -> str:
    """The NetworkPolicy, Services and Pods that a backend starting ``specs`` creates, as multi-document
    YAML (for ``--yaml``); with a ``master_port``, the master's Service too."""
    manifests.validate_job_name(job_name)
    documents: list[dict[str, Any]] = [manifests.network_policy_manifest(job_name, config)]
    if master_port:
        documents.append(manifests.master_service_manifest(job_name, config, master_port))
    for spec in specs:
        if spec.role is PodRole.PS:
            assert spec.port is not None
            documents.append(manifests.service_manifest(job_name, config, spec.pod_id, spec.port))
        documents.append(manifests.pod_manifest(job_name, config, spec))
    return yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False)


@dataclass(eq=False)
class _Pod:
    """The backend's record of one incarnation of a pod. Mutable fields are guarded by the backend lock."""

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


class KubernetesBackend(PodBackend):
    """Runs the pods of job ``job_name`` in a Kubernetes namespace (see the module docstring).

    Args:
        job_name: names and labels every object (``<job>-worker-3``); at most
            :data:`~edl_argo.pods.manifests.MAX_JOB_NAME` characters of ``[a-z0-9-]``.
        config: image, namespace, resources, owner, ... of the pods.
        api: the API client; default :func:`load_api_client`. A client passed in is not closed.

    The constructor lists the job's existing pods and Services (adoption) and starts the watch thread;
    throttling (429), server errors (5xx) and lost connections meanwhile are retried with backoff for
    :data:`START_RETRY_SECONDS` (an API server restarting).

    Raises:
        ConfigError: an invalid job name, no API server configured, one that refuses a request (403 RBAC,
            404 unknown namespace, 422 invalid object), or a job name used by another step.
        JobFailedError: the API server kept failing or could not be reached for START_RETRY_SECONDS.
    """

    keeps_job_secret = True

    def __init__(self, job_name: str, config: KubernetesConfig, api: k8s.ApiClient | None = None) -> None:
        self.job_name = manifests.validate_job_name(job_name)
        self.config = config
        self._client = api if api is not None else load_api_client()
        self._own_client = api is None
        self._api = JobApi(self._client, config.namespace, manifests.job_selector(job_name, config.step))
        self._lock = threading.Lock()
        self._pods: dict[_PodKey, _Pod] = {}
        self._stale_uids: dict[_PodKey, deque[str]] = {}
        self._leftovers: list[tuple[str, str]] = []  # (name, uid) of finished pods of earlier incarnations
        self._returned_uids: set[str] = set()  # of the adopted pods adopt() returned
        self._ports: dict[_PodKey, int] = {}
        self._addresses: dict[int, str] = {}
        self._queue = EventQueue()
        self._creators: set[threading.Thread] = set()
        self._closed = False
        self._close_done = False
        self._closing = threading.Event()  # set by close: creators stop retrying
        self._unwatch = threading.Event()  # set once close no longer needs the watch
        resource_version = self._start_up()
        self._watcher = threading.Thread(
            target=self._watch, args=(resource_version,), name=f"{job_name}-watch", daemon=True
        )
        self._watcher.start()

    # -- PodBackend ------------------------------------------------------------------------------

    def start(self, spec: PodSpec) -> None:
        key = (spec.role, spec.pod_id)
        with self._lock:
            admit_start(spec, closed=self._closed, live=self._pods, ports=self._ports)
            name = manifests.object_name(self.job_name, spec.role, spec.pod_id)
            pod = self._pods[key] = _Pod(spec.role, spec.pod_id, name, spec, creating=True)
        if spec.role is PodRole.PS and spec.pod_id not in self._addresses:
            assert spec.port is not None
            problem = self._create_service(spec.pod_id, spec.port)
            if problem:
                with self._lock:
                    pod.creating = False
                    self._finish(pod, PodPhase.FAILED, PodReason.ERROR, None, problem)
                return
        creator = threading.Thread(target=self._create, args=(pod,), name=f"{name}-create", daemon=True)
        with self._lock:
            self._creators.add(creator)
        creator.start()

    def stored_job_secret(self) -> JobSecret | None:
        name = manifests.auth_secret_name(self.job_name)
        deadline = time.monotonic() + START_RETRY_SECONDS
        found = self._starting(lambda: self._api.read_secret(name), f"read Secret {name}", deadline)
        return manifests.read_auth_secret(self.job_name, found) if found is not None else None

    def use_job_secret(self, secret: JobSecret) -> None:
        body = manifests.auth_secret_manifest(self.job_name, self.config, secret)
        deadline = time.monotonic() + START_RETRY_SECONDS
        name = body["metadata"]["name"]
        self._starting(lambda: self._api.create_secret(body), f"create Secret {name}", deadline)
        super().use_job_secret(secret)

    def adopt(self) -> list[PodStatus]:
        with self._lock:
            if self._closed:
                raise BackendClosedError("cannot adopt pods: the backend is closed")
            fresh = [
                pod
                for pod in self._pods.values()
                if pod.spec is None and not pod.terminal and pod.uid not in self._returned_uids
            ]
            self._returned_uids.update(pod.uid for pod in fresh if pod.uid)
            adopted = [PodStatus(pod.role, pod.pod_id, pod.phase) for pod in fresh]
            leftovers, self._leftovers = self._leftovers, []
        for name, uid in leftovers:
            log.info("pod_leftover_removed", job=self.job_name, pod=name, uid=uid)
            self._delete_pod(name, uid, 0)
        return sorted(adopted, key=lambda status: (status.role.value, status.pod_id))

    def expose_master(self, address: str) -> str:
        port = split_host_port(address)[1]
        own_pod = os.environ.get("EDL_POD_NAME", "")
        labels = ((self._read_own_pod() or {}).get("metadata") or {}).get("labels") or {}
        wanted = manifests.master_labels(self.job_name)
        if any(labels.get(key) != value for key, value in wanted.items()):
            log.info(
                "master_service_skipped",
                job=self.job_name,
                pod=own_pod or "none",
                reason="the master's pod does not carry " + ",".join(f"{k}={v}" for k, v in wanted.items()),
            )
            return address
        body = manifests.master_service_manifest(self.job_name, self.config, port)
        service, problem = self._ensure_service(body)
        if service is not None and service["spec"]["ports"][0]["port"] != port:  # a fresh start's port
            try:
                self._api.delete_service(body["metadata"]["name"])
                service, problem = self._ensure_service(body)
            except (ApiException, *CONNECTION_ERRORS) as error:
                service, problem = None, str(error)
        if service is None:
            log.warning("master_service_failed", job=self.job_name, error=problem)
            return address
        stable = join_host_port(service["spec"]["clusterIP"], port)
        log.info("master_service", job=self.job_name, service=body["metadata"]["name"], address=stable)
        return stable

    def delete(
        self, role: PodRole, pod_id: int, *, reason: str = PodReason.DELETED, grace_seconds: float = 5.0
    ) -> None:
        with self._lock:
            pod = self._pods.get((role, pod_id))
            if pod is None or pod.terminal:
                return
            if pod.delete_reason is None:
                pod.delete_reason = reason
                log.info("pod_delete", job=self.job_name, pod=pod.name, reason=reason, grace_s=grace_seconds)
            uid = pod.uid
        if uid is not None:  # else its creator deletes it once created, or never creates it
            self._delete_pod(pod.name, uid, grace_seconds)

    def events(self, timeout: float | None = None) -> list[PodEvent]:
        events = self._queue.take(timeout)
        with self._lock:
            for event in events:
                if event.phase.is_terminal:
                    key = (event.role, event.pod_id)
                    pod = self._pods.pop(key, None)
                    if pod is not None and pod.uid is not None:
                        self._stale_uids.setdefault(key, deque(maxlen=_STALE_UIDS)).append(pod.uid)
        return events

    def address(self, role: PodRole, pod_id: int) -> str:
        if role is not PodRole.PS:
            raise ValueError(f"{pod_name(role, pod_id)} does not listen on a port")
        with self._lock:
            address = self._addresses.get(pod_id)
        if address is None:
            name = manifests.object_name(self.job_name, role, pod_id)
            try:
                address = self._remember_service(self._api.read_service(name))
            except ApiException as error:
                if error.status != 404:
                    raise
            if address is None:
                raise KeyError(f"{pod_name(role, pod_id)} has no Service {name}, so it has no address")
        return address

    def list_pods(self) -> list[PodStatus]:
        with self._lock:
            return [
                PodStatus(role, pod_id, pod.phase)
                for (role, pod_id), pod in sorted(self._pods.items(), key=lambda i: (i[0][0].value, i[0][1]))
            ]

    def close(self, *, grace_seconds: float = 5.0) -> None:
        with self._lock:
            if self._close_done:
                return
            self._closed = True
            for pod in self._pods.values():
                if not pod.terminal and pod.delete_reason is None:
                    pod.delete_reason = PodReason.DELETED
            creators = list(self._creators)
        self._closing.set()
        for creator in creators:
            creator.join(REQUEST_SECONDS + 1)
        deadline = time.monotonic() + max(grace_seconds, 1.0) + CLOSE_EXTRA_SECONDS
        remaining = self._delete_everything(grace_seconds)
        while remaining and time.monotonic() < deadline:
            time.sleep(0.2)
            remaining = self._list_everything()
        while not self._all_terminal() and time.monotonic() < deadline:
            time.sleep(0.05)  # the watch reports the last terminal events
        self._unwatch.set()
        self._api.interrupt_watch()
        self._watcher.join(REQUEST_SECONDS)
        with self._lock:
            for pod in self._pods.values():
                self._finish(
                    pod, PodPhase.DELETED, PodReason.DELETED, None, "deleted when the backend closed"
                )
            self._close_done = True
        self._queue.close()
        if remaining:
            log.warning("pods_left_after_close", job=self.job_name, objects=",".join(remaining))
        if self._own_client:
            self._client.close()

    def _read_own_pod(self) -> dict[str, Any] | None:
        """The master's own pod (``EDL_POD_NAME``), whose labels and imagePullSecrets the job uses; None
        outside a pod or if it cannot be read (logged)."""
        own_pod = os.environ.get("EDL_POD_NAME", "")
        if not own_pod:
            return None
        try:
            pod: dict[str, Any] = retry_transient(
                lambda: self._api.read_pod(own_pod), "read the master's pod", time.monotonic() + 30
            )
            return pod
        except (ApiException, *CONNECTION_ERRORS) as error:
            log.warning("master_pod_unreadable", job=self.job_name, pod=own_pod, error=str(error))
            return None

    # -- creation --------------------------------------------------------------------------------

    def _create(self, pod: _Pod) -> None:
        """Create ``pod``'s object, retrying per the module docstring (the creator thread of ``pod``)."""
        assert pod.spec is not None
        manifest = manifests.pod_manifest(
            self.job_name, self.config, pod.spec, credentials=self.job_secret is not None
        )
        deadline = time.monotonic() + self.config.pod_creation_timeout
        delay, reported = RETRY_FIRST_SECONDS, ""
        try:
            while True:
                with self._lock:
                    if pod.delete_reason is not None or self._closed:
                        pod.creating = False
                        reason = pod.delete_reason or PodReason.DELETED
                        self._finish(pod, PodPhase.DELETED, reason, None, "deleted before it was created")
                        return
                try:
                    self._add_credential(pod)
                    self._created(pod, self._api.create_pod(manifest)["metadata"]["uid"])
                    return
                except ApiException as error:
                    retry, problem = self._creation_refused(pod, error)
                except CONNECTION_ERRORS as error:
                    retry, problem = True, f"the API server is unreachable: {error}"
                if not retry and not problem:
                    return  # the conflicting pod was our own creation
                if problem and (not retry or time.monotonic() + delay > deadline):
                    with self._lock:
                        pod.creating = False
                        self._finish(pod, PodPhase.FAILED, PodReason.ERROR, None, f"cannot create: {problem}")
                    return
                if problem and problem != reported:
                    reported = problem
                    log.warning("pod_create_retry", job=self.job_name, pod=pod.name, error=problem)
                    self._report_pending(pod, f"cannot create the pod yet, retrying: {problem}")
                if not self._closing.wait(delay):
                    delay = min(delay * 2, RETRY_MAX_SECONDS)
        finally:
            with self._lock:
                self._creators.discard(threading.current_thread())

    def _add_credential(self, pod: _Pod) -> None:
        """Put a worker's own token in the job's Secret (under its identity) before its pod is created."""
        if pod.role is not PodRole.WORKER or self.job_secret is None:
            return
        identity = pod_identity(pod.role.value, pod.pod_id)
        data = manifests.auth_secret_data({identity: self.job_secret.token(identity)})
        self._api.add_secret_data(manifests.auth_secret_name(self.job_name), data)

    def _creation_refused(self, pod: _Pod, error: ApiException) -> tuple[bool, str]:
        """``(retry, problem)`` after a refused creation; ``(True, "")``: retry, nothing to report;
        ``(False, "")``: the pod exists and is ours."""
        if error.status == 409:
            return self._resolve_conflict(pod)
        problem = api_message(error)
        if error.status == 403 and "cannot create resource" in problem:
            return False, problem + " (give the master's service account the Role of templates/rbac.yaml)"
        return error.status in RETRYABLE_STATUSES, problem

    def _resolve_conflict(self, pod: _Pod) -> tuple[bool, str]:
        """A pod named like ``pod`` exists: wait for it to go, remove it, or take it as ours."""
        try:
            existing = self._api.read_pod(pod.name)
        except ApiException as error:
            return error.status == 404, "" if error.status == 404 else api_message(error)
        meta = existing["metadata"]
        key = (pod.role, pod.pod_id)
        with self._lock:
            stale = meta["uid"] in self._stale_uids.get(key, ())
        if meta.get("deletionTimestamp"):
            return True, ""
        if stale or (existing.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            log.info("pod_previous_removed", job=self.job_name, pod=pod.name, uid=meta["uid"])
            self._delete_pod(pod.name, meta["uid"], 0)
            return True, ""
        labels = meta.get("labels") or {}
        if manifests.pod_key(labels) == key and labels.get(manifests.INSTANCE_LABEL) == self.job_name:
            self._created(pod, meta["uid"])  # our own creation, whose answer was lost
            return False, ""
        return False, f"a pod named {pod.name} exists and is not part of job {self.job_name}"

    def _created(self, pod: _Pod, uid: str) -> None:
        with self._lock:
            if pod.uid is None:
                pod.uid = uid
            pod.creating = False
            delete = pod.delete_reason is not None and not pod.terminal
        log.info("pod_created", job=self.job_name, pod=pod.name, uid=uid)
        if delete:
            self._delete_pod(pod.name, uid, 1)

    def _create_service(self, ps_id: int, port: int) -> str:
        """Create (or find) PS ``ps_id``'s Service and remember its address; returns a problem or ``""``."""
        body = manifests.service_manifest(self.job_name, self.config, ps_id, port)
        service, problem = self._ensure_service(body)
        if service is None:
            return problem
        existing = service["spec"]["ports"][0]["port"]
        if existing != port:
            return f"its Service {body['metadata']['name']} exists with port {existing}, not {port}"
        self._remember_service(service)
        return ""

    def _ensure_service(self, body: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """Create the Service ``body``, or take the one of its name an earlier master created, retrying
        like a pod's creation for at most a minute; returns ``(service, "")`` or ``(None, problem)``."""
        name = body["metadata"]["name"]
        deadline = time.monotonic() + min(self.config.pod_creation_timeout, 60.0)
        delay = RETRY_FIRST_SECONDS
        while True:
            try:
                try:
                    return self._api.create_service(body), ""
                except ApiException as error:
                    if error.status != 409:
                        raise
                    return self._api.read_service(name), ""  # created by an earlier master: keep it
            except ApiException as error:
                retry, problem = error.status in RETRYABLE_STATUSES, api_message(error)
            except CONNECTION_ERRORS as error:
                retry, problem = True, str(error)
            if not retry or time.monotonic() + delay > deadline or self._closing.wait(delay):
                return None, f"cannot create Service {name}: {problem}"
            delay = min(delay * 2, RETRY_MAX_SECONDS)

    def _remember_service(self, service: dict[str, Any]) -> str | None:
        """Record a PS Service's address (and port); returns it, or None if it is not a PS's Service."""
        key = manifests.pod_key(service["metadata"].get("labels"))
        if key is None or key[0] is not PodRole.PS:
            return None
        port = int(service["spec"]["ports"][0]["port"])
        host = service["spec"].get("clusterIP") or "None"
        if host == "None":  # headless (not one of ours): its DNS name
            host = f"{service['metadata']['name']}.{self.config.namespace}.svc"
        with self._lock:
            address = self._addresses[key[1]] = join_host_port(host, port)
            self._ports.setdefault(key, port)
        return address

    # -- deletion --------------------------------------------------------------------------------

    def _delete_pod(self, name: str, uid: str, grace_seconds: float) -> None:
        """Ask the API to delete incarnation ``uid`` of pod ``name``, trying three times."""
        for attempt in range(3):
            try:
                self._api.delete_pod(name, uid, grace_seconds)
                return
            except ApiException as error:
                problem = api_message(error)
            except CONNECTION_ERRORS as error:
                problem = str(error)
            log.warning("pod_delete_failed", job=self.job_name, pod=name, attempt=attempt + 1, error=problem)
            time.sleep(RETRY_FIRST_SECONDS * 2**attempt)

    def _start_up(self) -> str:
        """What the constructor asks the API (see the module docstring): refuse another step's job name,
        adopt the job's Services and pods, read the master's own pod, create the NetworkPolicy. Returns the
        pods' resourceVersion. Transient failures are retried until :data:`START_RETRY_SECONDS` have
        passed, then :class:`JobFailedError`; a refusal (403, an unknown namespace, an invalid object) is a
        :class:`ConfigError` at once."""
        config, deadline = self.config, time.monotonic() + START_RETRY_SECONDS
        any_step = JobApi(self._client, config.namespace, manifests.job_selector(self.job_name))
        others = self._starting(
            lambda: objects_of_other_steps(any_step, config.step),
            "list the job's pods and services",
            deadline,
        )
        if others:
            raise ConfigError(
                f"--job-name {self.job_name}: namespace {config.namespace} holds {', '.join(others)} of"
                f" another step of that job name (label {manifests.STEP_LABEL}); give each training task its"
                " own job name"
            )
        for service in self._starting(self._api.list_services, "list services", deadline):
            self._remember_service(service)
        resource_version = self._starting(self._relist, "list pods", deadline)
        own_pod = self._read_own_pod()
        if not config.image_pull_secrets and own_pod is not None:
            secrets = (own_pod.get("spec") or {}).get("imagePullSecrets") or []
            names = tuple(secret["name"] for secret in secrets if secret.get("name"))
            self.config = dataclasses.replace(config, image_pull_secrets=names)
        policy = manifests.network_policy_manifest(self.job_name, self.config)
        what = f"create NetworkPolicy {policy['metadata']['name']}"
        self._starting(lambda: self._api.create_network_policy(policy), what, deadline)
        return resource_version

    def _starting(self, call: Callable[[], Result], action: str, deadline: float) -> Result:
        """``call()`` at start-up, retried as :meth:`_start_up` says, its failure a one-line error."""
        try:
            return retry_transient(call, action, deadline)
        except ApiException as error:
            if is_transient(error):
                raise JobFailedError(
                    f"--backend kubernetes: the Kubernetes API still answers {api_message(error)} after"
                    f" {START_RETRY_SECONDS:.0f} s of retries to {action}"
                ) from None
            raise ConfigError(
                f"--backend kubernetes: cannot {action} in namespace {self.config.namespace}:"
                f" {api_message(error)} (the master's service account needs templates/rbac.yaml)"
            ) from None
        except CONNECTION_ERRORS as error:
            raise JobFailedError(
                f"--backend kubernetes: cannot reach the Kubernetes API after {START_RETRY_SECONDS:.0f} s of"
                f" retries to {action}: {type(error).__name__}"
            ) from None

    def _delete_everything(self, grace_seconds: float) -> list[str]:
        """Delete every pod and Service of the job, and its NetworkPolicy; returns ``kind/name`` of the pods
        and Services that still exist."""
        try:
            delete_job_objects(self._api, self.job_name, grace_seconds)
        except (ApiException, *CONNECTION_ERRORS) as error:
            log.warning("job_delete_failed", job=self.job_name, error=str(error))
        return self._list_everything()

    def _list_everything(self) -> list[str]:
        """``kind/name`` of every pod and Service of the job (``["?"]`` if the API cannot tell)."""
        try:
            return job_objects(self._api)
        except (ApiException, *CONNECTION_ERRORS) as error:
            log.warning("job_list_failed", job=self.job_name, error=str(error))
            return ["?"]

    # -- watching --------------------------------------------------------------------------------

    def _watch(self, resource_version: str | None) -> None:
        """Turn the job's pod changes into events until :meth:`close` (the watch thread)."""
        delay = RETRY_FIRST_SECONDS
        while not self._unwatch.is_set():
            try:
                if resource_version is None:
                    resource_version = self._relist()
                    log.info("pods_relisted", job=self.job_name, resource_version=resource_version)
                began = time.monotonic()
                resource_version = self._watch_once(resource_version)
                if time.monotonic() - began < 1.0:  # a server that ends watches at once: do not spin
                    self._unwatch.wait(RETRY_FIRST_SECONDS)
                delay = RETRY_FIRST_SECONDS
            except ApiException as error:
                if error.status == 410:
                    resource_version = None
                    continue
                self._watch_trouble(api_message(error), delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
            except (*CONNECTION_ERRORS, ValueError, KeyError) as error:
                self._watch_trouble(f"{type(error).__name__}: {error}", delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)

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

    def _watch_trouble(self, problem: str, delay: float) -> None:
        if not self._unwatch.is_set():
            log.warning("watch_failed", job=self.job_name, error=problem, retry_in_s=delay)
            self._unwatch.wait(delay)

    def _relist(self) -> str:
        """List the job's pods, adopt unknown ones and report what changed since they were last seen;
        returns the list's resourceVersion."""
        listed = self._api.list_pods()
        seen: set[str] = set()
        for obj in listed["items"]:
            seen.add(obj["metadata"]["uid"])
            self._adopt(obj)
            self._observe(obj)
        with self._lock:
            vanished = [p for p in self._pods.values() if p.uid and p.uid not in seen and not p.terminal]
        for pod in vanished:
            self._observe({"metadata": {"uid": pod.uid}}, gone=True, record=pod)
        return str(listed["metadata"]["resourceVersion"])

    def _adopt(self, obj: dict[str, Any]) -> None:
        """Track a running pod of the job that no incarnation known to this backend accounts for."""
        meta = obj["metadata"]
        key = manifests.pod_key(meta.get("labels"))
        if key is None or meta.get("deletionTimestamp"):
            return
        with self._lock:
            if key in self._pods or meta["uid"] in self._stale_uids.get(key, ()) or self._closed:
                return
            if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                self._stale_uids.setdefault(key, deque(maxlen=_STALE_UIDS)).append(meta["uid"])
                self._leftovers.append((meta["name"], meta["uid"]))
                return  # a finished incarnation: kept for its logs until adopt() or close
            self._pods[key] = _Pod(key[0], key[1], meta["name"], uid=meta["uid"])
        log.info("pod_adopted", job=self.job_name, pod=meta["name"], uid=meta["uid"])

    def _observe(self, obj: dict[str, Any], gone: bool = False, record: _Pod | None = None) -> None:
        """Report what a new version of a pod object (or its deletion) means for its incarnation."""
        with self._lock:
            pod = record or self._claimant(obj)
            if pod is None or pod.terminal:
                return
            seen = observe_pod(obj, gone)
            change = self._transition(pod, seen)
            if change is None:
                return
            phase, reason, message = change
            if not phase.is_terminal:
                self._queue_event(pod, phase, reason, None, message)
                return
        if phase is PodPhase.FAILED and reason == PodReason.ERROR and not seen.stuck and not gone:
            tail = self._api.pod_log_tail(pod.name)
            if tail:
                message += "; last lines of its log:\n" + "\n".join(tail)
        with self._lock:
            self._finish(pod, phase, reason, seen.exit_code, message)
        if seen.stuck and not seen.deleting:  # the kubelet would retry it forever
            self._delete_pod(pod.name, obj["metadata"]["uid"], 1)

    def _claimant(self, obj: dict[str, Any]) -> _Pod | None:
        """The incarnation ``obj`` belongs to, if this backend tracks it. Called with the lock held."""
        key = manifests.pod_key(obj["metadata"].get("labels"))
        pod = self._pods.get(key) if key is not None else None
        uid = obj["metadata"]["uid"]
        if pod is None or key is None:
            return None
        if pod.uid is None and uid not in self._stale_uids.get(key, ()):
            pod.uid = uid  # its first watch event came before the answer to its creation
        return pod if pod.uid == uid else None

    def _transition(self, pod: _Pod, seen: PodObservation) -> tuple[PodPhase, str, str] | None:
        """The event (phase, reason, message) that ``seen`` means for ``pod``, if any. With the lock."""
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

    def _report_pending(self, pod: _Pod, message: str) -> None:
        with self._lock:
            if not pod.terminal:
                self._queue_event(pod, PodPhase.PENDING, PodReason.UNSCHEDULABLE, None, message)

    def _queue_event(
        self, pod: _Pod, phase: PodPhase, reason: str, exit_code: int | None, message: str
    ) -> None:
        self._queue.put(PodEvent(pod.role, pod.pod_id, phase, exit_code, reason, message, time.time()))

    def _finish(self, pod: _Pod, phase: PodPhase, reason: str, exit_code: int | None, message: str) -> None:
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
        self._queue_event(pod, phase, reason, exit_code, message[-_MESSAGE_MAX_CHARS:])

    def _all_terminal(self) -> bool:
        with self._lock:
            return all(pod.terminal for pod in self._pods.values())
