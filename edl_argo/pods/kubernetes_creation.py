"""Creating and deleting a job's Kubernetes objects through the API, with retries, backoff and deadlines.

:class:`JobObjects` creates each pod on a thread of its own (:meth:`JobObjects.launch` returns at once),
retried with exponential backoff (0.2 s doubling to 10 s, or longer when a 429 or 503 says ``Retry-After``)
for ``pod_creation_timeout`` seconds on quota and admission refusals (403), throttling (429), server errors
(5xx) and lost connections; its requests wait for the request budget until that deadline: the first refusal
is reported as a PENDING/``Unschedulable`` event quoting the API's message, running out of time as
FAILED/``Error``. Other refusals (400, 401, 404, 422, an RBAC denial) are FAILED/``Error`` at once:
retrying cannot help. A 409 Conflict means a pod of that name still exists: one being deleted is waited
for, a finished one (a PS's previous incarnation) is deleted with a uid precondition, then creation is
retried; one the job created whose answer was lost is taken as the creation's. A worker's own token is
added to the job's Secret before its pod is created, with the tokens of the other workers being created
then (:mod:`edl_argo.pods.secret_tokens`). A pod deleted while it was being created is deleted
once created, or never created. Services (a PS's, the master's) are created like pods for at most a
minute, one of the same name that an earlier master created being kept. Deleting a pod is tried three
times; deleting the whole job waits, within a deadline, until its pods and Services are gone (told by the
watch, confirmed by a list).

:class:`StartupCalls` makes the calls of a backend's start-up: transient failures (429, 5xx, no connection)
are retried until :data:`START_RETRY_SECONDS` have passed, then :class:`~edl_argo.errors.JobFailedError`;
a refusal (403, an unknown namespace, an invalid object) is a :class:`~edl_argo.errors.ConfigError` at
once. Both errors are one line.

Object bodies come from :mod:`edl_argo.pods.manifests`; what a pod's creation means for its events is
recorded in :class:`~edl_argo.pods.kubernetes_pods.JobPods`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client.rest import ApiException

from edl_argo.errors import ConfigError, JobFailedError
from edl_argo.pods import manifests
from edl_argo.pods.base import PodPhase, PodReason, PodRole
from edl_argo.pods.cleanup import delete_job_objects, job_objects
from edl_argo.pods.kubernetes_api import (
    CONNECTION_ERRORS,
    REQUEST_SECONDS,
    RETRY_FIRST_SECONDS,
    RETRY_MAX_SECONDS,
    JobApi,
    Result,
    api_message,
    is_transient,
    retry_delay,
    retry_fields,
    retry_transient,
)
from edl_argo.pods.kubernetes_config import KubernetesConfig
from edl_argo.pods.kubernetes_pods import Incarnation, JobPods, log
from edl_argo.pods.kubernetes_status import has_finished
from edl_argo.pods.secret_tokens import SecretTokens
from edl_argo.rpc.auth import JobSecret, pod_identity

#: How long a backend's start-up retries transient API failures (429, 5xx, no connection) before giving up.
START_RETRY_SECONDS = 120.0
#: API statuses worth retrying a creation on (quota, admission, throttling, server trouble).
RETRYABLE_STATUSES = frozenset({403, 429, 500, 502, 503, 504})
#: Longest time a Service's creation is retried.
SERVICE_CREATION_MAX_SECONDS = 60.0
#: While the watch has not seen every pod of a closing job stop, how often the job is listed to see what is
#: left (:meth:`JobObjects.delete_job`).
GONE_LIST_SECONDS = 1.0
#: Longest time the retries of a pod's deletion wait in all.
DELETE_RETRY_SECONDS = 30.0

_Json = dict[str, Any]


class StartupCalls:
    """The API calls of one start-up step, sharing one deadline :data:`START_RETRY_SECONDS` from now."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.deadline = time.monotonic() + START_RETRY_SECONDS

    def __call__(self, call: Callable[[], Result], action: str) -> Result:
        """``call()``, retried as the module says; its failure a one-line error naming ``action``."""
        try:
            return retry_transient(call, action, self.deadline)
        except ApiException as error:
            if is_transient(error):
                raise JobFailedError(
                    f"--backend kubernetes: the Kubernetes API still answers {api_message(error)} after"
                    f" {START_RETRY_SECONDS:.0f} s of retries to {action}"
                ) from None
            raise ConfigError(
                f"--backend kubernetes: cannot {action} in namespace {self.namespace}:"
                f" {api_message(error)} (the master's service account needs templates/rbac.yaml)"
            ) from None
        except CONNECTION_ERRORS as error:
            raise JobFailedError(
                f"--backend kubernetes: cannot reach the Kubernetes API after {START_RETRY_SECONDS:.0f} s of"
                f" retries to {action}: {type(error).__name__}"
            ) from None


class JobObjects:
    """Creates and deletes the objects of job ``pods.job_name`` through ``api`` (see the module docstring).

    Creator threads stop retrying once :meth:`stop` is called.
    """

    def __init__(self, api: JobApi, pods: JobPods) -> None:
        self._api = api
        self._pods = pods
        self.job_name = pods.job_name
        self._creators: set[threading.Thread] = set()  # guarded by pods.lock
        self._closing = threading.Event()
        self._tokens: SecretTokens | None = None  # the workers' tokens in the job's Secret, once there is one

    # -- pods ------------------------------------------------------------------------------------

    def launch(self, pod: Incarnation, config: KubernetesConfig, job_secret: JobSecret | None) -> None:
        """Create ``pod`` (its spec, with ``config``, credentials from ``job_secret`` if any) on a thread."""
        creator = threading.Thread(
            target=self._create, args=(pod, config, job_secret), name=f"{pod.name}-create", daemon=True
        )
        with self._pods.lock:
            self._creators.add(creator)
        creator.start()

    def _create(self, pod: Incarnation, config: KubernetesConfig, job_secret: JobSecret | None) -> None:
        """Create ``pod``'s object, retrying per the module docstring (the creator thread of ``pod``)."""
        assert pod.spec is not None
        pods = self._pods
        manifest = manifests.pod_manifest(self.job_name, config, pod.spec, credentials=job_secret is not None)
        deadline = time.monotonic() + config.pod_creation_timeout
        backoff, reported = RETRY_FIRST_SECONDS, ""
        try:
            while True:
                with pods.lock:
                    if pod.delete_reason is not None or pods.closed:
                        pod.creating = False
                        reason = pod.delete_reason or PodReason.DELETED
                        pods.finish(pod, PodPhase.DELETED, reason, None, "deleted before it was created")
                        return
                try:
                    self._add_credential(pod, config, job_secret, deadline)
                    self._created(pod, self._api.create_pod(manifest, deadline)["metadata"]["uid"])
                    return
                except ApiException as error:
                    failure: Exception = error
                    retry, problem = self._creation_refused(pod, error)
                except CONNECTION_ERRORS as error:
                    failure = error
                    retry, problem = True, f"the API server is unreachable: {error}"
                if not retry and not problem:
                    return  # the conflicting pod was our own creation
                delay = retry_delay(failure, backoff)
                if problem and (not retry or time.monotonic() + delay > deadline):
                    with pods.lock:
                        pod.creating = False
                        pods.finish(pod, PodPhase.FAILED, PodReason.ERROR, None, f"cannot create: {problem}")
                    return
                if problem and problem != reported:
                    reported = problem
                    log.warning(
                        "pod_create_retry", job=self.job_name, pod=pod.name, **retry_fields(failure, delay)
                    )
                    pods.report_pending(pod, f"cannot create the pod yet, retrying: {problem}")
                if not self._closing.wait(delay):
                    backoff = min(backoff * 2, RETRY_MAX_SECONDS)
        finally:
            with pods.lock:
                self._creators.discard(threading.current_thread())

    def _add_credential(
        self, pod: Incarnation, config: KubernetesConfig, job_secret: JobSecret | None, deadline: float
    ) -> None:
        """Put a worker's own token in the job's Secret (under its identity) before its pod is created
        (waiting for the request budget until ``deadline``)."""
        if pod.role is not PodRole.WORKER or job_secret is None:
            return
        with self._pods.lock:
            if self._tokens is None:
                secret = manifests.job_auth_secret(self.job_name, config)
                self._tokens = SecretTokens(
                    lambda tokens, until: self._api.add_secret_data(
                        secret, manifests.auth_secret_data(tokens), until
                    )
                )
            tokens = self._tokens
        identity = pod_identity(pod.role.value, pod.pod_id)
        tokens.add(identity, job_secret.token(identity), deadline)

    def _creation_refused(self, pod: Incarnation, error: ApiException) -> tuple[bool, str]:
        """``(retry, problem)`` after a refused creation; ``(True, "")``: retry, nothing to report;
        ``(False, "")``: the pod exists and is ours."""
        if error.status == 409:
            return self._resolve_conflict(pod)
        problem = api_message(error)
        if error.status == 403 and "cannot create resource" in problem:
            return False, problem + " (give the master's service account the Role of templates/rbac.yaml)"
        return error.status in RETRYABLE_STATUSES, problem

    def _resolve_conflict(self, pod: Incarnation) -> tuple[bool, str]:
        """A pod named like ``pod`` exists: wait for it to go, remove it, or take it as ours."""
        try:
            existing = self._api.read_pod(pod.name)
        except ApiException as error:
            return error.status == 404, "" if error.status == 404 else api_message(error)
        meta = existing["metadata"]
        key = (pod.role, pod.pod_id)
        with self._pods.lock:
            stale = self._pods.is_stale(key, meta["uid"])
        if meta.get("deletionTimestamp"):
            return True, ""
        if stale or has_finished(existing):
            log.info("pod_previous_removed", job=self.job_name, pod=pod.name, uid=meta["uid"])
            self.delete_pod(pod.name, meta["uid"], 0)
            return True, ""
        labels = meta.get("labels") or {}
        if manifests.pod_key(labels) == key and labels.get(manifests.INSTANCE_LABEL) == self.job_name:
            self._created(pod, meta["uid"])  # our own creation, whose answer was lost
            return False, ""
        return False, f"a pod named {pod.name} exists and is not part of job {self.job_name}"

    def _created(self, pod: Incarnation, uid: str) -> None:
        with self._pods.lock:
            if pod.uid is None:
                pod.uid = uid
            pod.creating = False
            delete = pod.delete_reason is not None and not pod.terminal
        log.info("pod_created", job=self.job_name, pod=pod.name, uid=uid)
        if delete:
            self.delete_pod(pod.name, uid, 1)

    def delete_pod(self, name: str, uid: str, grace_seconds: float) -> None:
        """Ask the API to delete incarnation ``uid`` of pod ``name``, trying three times (the retries after
        a backoff, or the server's ``Retry-After`` if longer, within :data:`DELETE_RETRY_SECONDS`)."""
        deadline = time.monotonic() + DELETE_RETRY_SECONDS
        for attempt in range(1, 4):
            try:
                self._api.delete_pod(name, uid, grace_seconds)
                return
            except (ApiException, *CONNECTION_ERRORS) as error:
                failure: Exception = error
            delay = retry_delay(failure, RETRY_FIRST_SECONDS * 2 ** (attempt - 1))
            fields = retry_fields(failure, delay)
            if attempt == 3 or time.monotonic() + delay > deadline:
                log.warning(
                    "pod_delete_failed", job=self.job_name, pod=name, attempt=attempt, error=fields["error"]
                )
                return
            log.warning("pod_delete_failed", job=self.job_name, pod=name, attempt=attempt, **fields)
            time.sleep(delay)

    # -- services --------------------------------------------------------------------------------

    def create_ps_service(self, ps_id: int, port: int, config: KubernetesConfig) -> str:
        """Create (or find) PS ``ps_id``'s Service and remember its address; returns a problem or ``""``."""
        body = manifests.service_manifest(self.job_name, config, ps_id, port)
        service, problem = self.ensure_service(body, config.pod_creation_timeout)
        if service is None:
            return problem
        existing = service["spec"]["ports"][0]["port"]
        if existing != port:
            return f"its Service {body['metadata']['name']} exists with port {existing}, not {port}"
        self._pods.remember_service(service)
        return ""

    def ensure_master_service(self, body: _Json, timeout: float) -> tuple[_Json | None, str]:
        """Like :meth:`ensure_service` for the master's Service ``body``, which an earlier master's Service
        of another port (a fresh start's) is replaced by."""
        port = body["spec"]["ports"][0]["port"]
        service, problem = self.ensure_service(body, timeout)
        if service is not None and service["spec"]["ports"][0]["port"] != port:
            try:
                self._api.delete_service(body["metadata"]["name"])
                service, problem = self.ensure_service(body, timeout)
            except (ApiException, *CONNECTION_ERRORS) as error:
                service, problem = None, str(error)
        return service, problem

    def ensure_service(self, body: _Json, timeout: float) -> tuple[_Json | None, str]:
        """Create the Service ``body``, or take the one of its name an earlier master created, retrying
        like a pod's creation for at most ``timeout`` seconds or a minute; returns ``(service, "")`` or
        ``(None, problem)``."""
        name = body["metadata"]["name"]
        deadline = time.monotonic() + min(timeout, SERVICE_CREATION_MAX_SECONDS)
        backoff = RETRY_FIRST_SECONDS
        while True:
            try:
                try:
                    return self._api.create_service(body), ""
                except ApiException as error:
                    if error.status != 409:
                        raise
                    return self._api.read_service(name), ""  # created by an earlier master: keep it
            except ApiException as error:
                failure: Exception = error
                retry, problem = error.status in RETRYABLE_STATUSES, api_message(error)
            except CONNECTION_ERRORS as error:
                failure = error
                retry, problem = True, str(error)
            delay = retry_delay(failure, backoff)
            if not retry or time.monotonic() + delay > deadline or self._closing.wait(delay):
                return None, f"cannot create Service {name}: {problem}"
            backoff = min(backoff * 2, RETRY_MAX_SECONDS)

    # -- the whole job ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Make creators stop retrying, and wait (boundedly) for the running ones to end."""
        with self._pods.lock:
            creators = list(self._creators)
        self._closing.set()
        for creator in creators:
            creator.join(REQUEST_SECONDS + 1)

    def delete_job(
        self, grace_seconds: float, deadline: float, auth_secret: str, settled: Callable[[], bool]
    ) -> list[str]:
        """Delete every pod and Service of the job, its NetworkPolicy and its auth Secret ``auth_secret``, and
        wait until ``deadline`` for them to be gone; returns ``kind/name`` of the pods and Services that still
        exist.

        The wait relies on the watch: the job is listed as soon as ``settled()`` (the watch has seen every
        pod stop), and otherwise only every :data:`GONE_LIST_SECONDS` (a watch cut off from the server), so
        closing a job of 1,000 pods costs a few lists, not one every fraction of a second."""
        try:
            delete_job_objects(self._api, self.job_name, auth_secret, grace_seconds)
        except (ApiException, *CONNECTION_ERRORS) as error:
            log.warning("job_delete_failed", job=self.job_name, error=str(error))
        listed_at, was_settled = time.monotonic(), settled()
        remaining = self._list_job()
        while remaining and time.monotonic() < deadline:
            time.sleep(0.05)
            now, now_settled = time.monotonic(), settled()
            if (now_settled and not was_settled) or now - listed_at >= GONE_LIST_SECONDS or now >= deadline:
                listed_at, remaining = now, self._list_job()
            was_settled = now_settled
        return remaining

    def _list_job(self) -> list[str]:
        """``kind/name`` of every pod and Service of the job (``["?"]`` if the API cannot tell)."""
        try:
            return job_objects(self._api)
        except (ApiException, *CONNECTION_ERRORS) as error:
            log.warning("job_list_failed", job=self.job_name, error=str(error))
            return ["?"]
