"""The Kubernetes API calls of one job, through the official client, answers as plain dicts.

:class:`JobApi` binds a ``kubernetes.client.ApiClient`` to a namespace and a job's label selector and
exposes exactly the calls the backend makes -- the ones ``templates/rbac.yaml`` grants: pods and services
(create, get, list, watch, delete), pods/log (get) and networkpolicies (create, delete). Every call but
the watch has a client-side timeout of :data:`REQUEST_SECONDS`. Errors are the client's:
``kubernetes.client.ApiException`` for an API refusal (:func:`api_message` quotes it), ``urllib3`` or
``OSError`` errors for a lost connection.

**Request budget.** Every request -- each call, each retry, each log read, the start of each watch -- first
takes a token of the :class:`~edl_argo.pods.request_budget.RequestBudget` the ``JobApi`` is given
(``--k8s-qps``, ``--k8s-burst``), waiting for it until the call's deadline (by default
:data:`REQUEST_SECONDS`); a call that gets no token in time fails with
:class:`~edl_argo.pods.request_budget.RequestBudgetTimeout`, a :class:`TimeoutError`: like a request that
timed out, it is transient (:func:`is_transient`).

**Retry-After.** A 429 or 503 answer with a ``Retry-After`` header (seconds) is retried no sooner than
that (:func:`retry_delay`), and not at all if that is past the call's deadline; the log line of the retry
says when it comes (``retry_in_s``, ``retry_at``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from edl_argo import __version__
from edl_argo.errors import ConfigError
from edl_argo.log import get_logger
from edl_argo.pods import manifests
from edl_argo.pods.request_budget import DEFAULT_BURST, DEFAULT_QPS, RequestBudget

#: Environment variable with the API server's URL; overrides in-cluster and kubeconfig settings.
API_URL_ENV = "EDL_KUBERNETES_API"
#: Client-side timeout of every request but watches.
REQUEST_SECONDS = 15.0
#: How many log lines :meth:`JobApi.pod_log_tail` returns, and its timeout (a failed pod's event waits
#: for it).
LOG_TAIL_LINES, LOG_READ_SECONDS = 10, 5.0

#: The errors of a request that got no answer (connection refused, reset, timed out).
CONNECTION_ERRORS = (urllib3.exceptions.HTTPError, OSError)
#: API statuses that mean "try again later": throttling and server trouble (an API server restarting).
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
#: Backoff of retried API calls: first delay, doubled up to the maximum.
RETRY_FIRST_SECONDS, RETRY_MAX_SECONDS = 0.2, 10.0
#: What urllib3 may retry by itself: a connection that could not be made (the server saw no request);
#: never a request the server answered or may have seen (see :func:`load_api_client`).
CLIENT_RETRIES = urllib3.util.Retry(
    total=3, connect=3, read=0, redirect=0, status=0, other=0, respect_retry_after_header=False
)
#: Statuses whose ``Retry-After`` header a retry honours (throttled; unavailable).
RETRY_AFTER_STATUSES = frozenset({429, 503})

Result = TypeVar("Result")

Json = dict[str, Any]

log = get_logger(__name__)


def load_api_client() -> k8s.ApiClient:
    """An API client for ``$EDL_KUBERNETES_API``, else the in-cluster service account, else kubeconfig.

    Its User-Agent is ``edl-argo/<version>``, so audit logs (and the test stand-in) can tell the master.
    Its connections retry only connecting (:data:`CLIENT_RETRIES`): urllib3's own retries would repeat
    a request past the request budget and the call's deadline (a 429 or 503 with ``Retry-After``, a
    read that timed out), so :func:`retry_transient` and the backend's loops make every retry.

    Raises:
        ConfigError: none of them is available.
    """
    configuration = k8s.Configuration()
    configuration.retries = CLIENT_RETRIES
    url = os.environ.get(API_URL_ENV, "").strip()
    if url:
        configuration.host = url.rstrip("/")
    else:
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException:
            try:
                k8s_config.load_kube_config(client_configuration=configuration)
            except (k8s_config.ConfigException, OSError) as error:
                raise ConfigError(
                    "--backend kubernetes: no in-cluster service account and no usable kubeconfig"
                    f" ({error}); run the master in a pod, set KUBECONFIG or {API_URL_ENV}"
                ) from None
    api = k8s.ApiClient(configuration)
    api.user_agent = f"edl-argo/{__version__}"
    return api


def api_message(error: ApiException) -> str:
    """``"<status> <message>"`` of an API refusal (the message of the Status it carries)."""
    try:
        message = json.loads(error.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"{error.status} {message or error.reason or ''}".strip()


def is_transient(error: BaseException) -> bool:
    """Whether a failed request may succeed if repeated: no answer, or a :data:`TRANSIENT_STATUSES`."""
    if isinstance(error, ApiException):
        return error.status in TRANSIENT_STATUSES
    return isinstance(error, CONNECTION_ERRORS)


def retry_after_seconds(error: BaseException) -> float | None:
    """The ``Retry-After`` of a 429 or 503 answer, in seconds; None without one (or an HTTP-date, which the
    API server does not send)."""
    if not isinstance(error, ApiException) or error.status not in RETRY_AFTER_STATUSES:
        return None
    headers = error.headers or {}
    value = headers.get("Retry-After") or headers.get("retry-after")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 and math.isfinite(seconds) else None


def retry_delay(error: BaseException, backoff: float) -> float:
    """How long to wait before retrying after ``error``: the backoff's ``backoff``, or the server's
    ``Retry-After`` (:func:`retry_after_seconds`) when that is longer."""
    return max(backoff, retry_after_seconds(error) or 0.0)


def retry_fields(error: BaseException, delay: float) -> dict[str, Any]:
    """The log fields of a retry in ``delay`` seconds after ``error``: ``error`` (one line), ``retry_in_s``,
    ``retry_at`` (UTC), and ``retry_after_s`` when the server asked for it."""
    problem = api_message(error) if isinstance(error, ApiException) else f"{type(error).__name__}: {error}"
    at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=delay)
    fields: dict[str, Any] = {
        "error": problem[:300],
        "retry_in_s": round(delay, 3),
        "retry_at": at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z",
    }
    server_asked = retry_after_seconds(error)
    if server_asked is not None:
        fields["retry_after_s"] = server_asked
    return fields


def retry_transient(call: Callable[[], Result], what: str, deadline: float) -> Result:
    """``call()``, repeated while it fails transiently (:func:`is_transient`) and the ``time.monotonic()``
    ``deadline`` allows, after a backoff or the server's ``Retry-After`` (:func:`retry_delay`); any other
    error, or the last one, is raised."""
    backoff = RETRY_FIRST_SECONDS
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except (ApiException, *CONNECTION_ERRORS) as error:
            delay = retry_delay(error, backoff)
            if not is_transient(error) or time.monotonic() + delay > deadline:
                raise
            log.warning("api_retry", action=what, attempt=attempt, **retry_fields(error, delay))
        time.sleep(delay)
        backoff = min(backoff * 2, RETRY_MAX_SECONDS)


class JobApi:
    """The calls of one job's backend in ``namespace``; listings are limited to ``selector``. Thread-safe.

    ``budget`` paces every request (see the module docstring); JobApis of one client should share one.
    Default: a budget of its own, of :data:`~edl_argo.pods.request_budget.DEFAULT_QPS` and
    :data:`~edl_argo.pods.request_budget.DEFAULT_BURST`.
    """

    def __init__(
        self, api: k8s.ApiClient, namespace: str, selector: str, budget: RequestBudget | None = None
    ) -> None:
        self.namespace = namespace
        self.selector = selector
        self.budget = budget if budget is not None else RequestBudget(DEFAULT_QPS, DEFAULT_BURST)
        self._core = k8s.CoreV1Api(api)
        self._networking = k8s.NetworkingV1Api(api)
        self._stream_lock = threading.Lock()
        self._stream: Any = None

    def list_pods(self) -> Json:
        """The PodList of the job (its ``metadata.resourceVersion`` is where a watch can start)."""
        return self._call(self._core.list_namespaced_pod, self.namespace, label_selector=self.selector)

    def list_services(self) -> list[Json]:
        listed = self._call(self._core.list_namespaced_service, self.namespace, label_selector=self.selector)
        items: list[Json] = listed["items"]
        return items

    def create_pod(self, body: Json, deadline: float | None = None) -> Json:
        """Create a pod, waiting for the request budget until ``deadline`` (default: :data:`REQUEST_SECONDS`
        from now)."""
        return self._call(self._core.create_namespaced_pod, self.namespace, body, deadline=deadline)

    def read_pod(self, name: str) -> Json:
        return self._call(self._core.read_namespaced_pod, name, self.namespace)

    def label_pod(self, name: str, labels: dict[str, str]) -> Json:
        """Add ``labels`` to pod ``name`` (a JSON merge patch: its other labels stay); returns the pod."""
        return self._call(
            self._core.patch_namespaced_pod,
            name,
            self.namespace,
            {"metadata": {"labels": labels}},
            _content_type="application/merge-patch+json",
        )

    def delete_pod(self, name: str, uid: str, grace_seconds: float) -> None:
        """Delete pod ``name`` if it still is incarnation ``uid``; one that is gone (404) or is another
        incarnation now (409) is fine. The grace period is rounded up to whole seconds, at least 1: 0
        would remove the object before its container stopped."""
        grace = max(1, math.ceil(grace_seconds))
        body = k8s.V1DeleteOptions(grace_period_seconds=grace, preconditions=k8s.V1Preconditions(uid=uid))
        try:
            self._call(self._core.delete_namespaced_pod, name, self.namespace, body=body)
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    def create_service(self, body: Json) -> Json:
        return self._call(self._core.create_namespaced_service, self.namespace, body)

    def read_service(self, name: str) -> Json:
        return self._call(self._core.read_namespaced_service, name, self.namespace)

    def delete_service(self, name: str) -> None:
        """Delete Service ``name``; one that is gone is fine."""
        try:
            self._call(self._core.delete_namespaced_service, name, self.namespace)
        except ApiException as error:
            if error.status != 404:
                raise

    def create_network_policy(self, body: Json) -> None:
        """Create the job's NetworkPolicy; one of that name that exists already (an earlier master of
        the job made it) is fine."""
        try:
            self._call(self._networking.create_namespaced_network_policy, self.namespace, body)
        except ApiException as error:
            if error.status != 409:
                raise

    def create_secret(self, body: Json) -> bool:
        """Create a Secret; True if created, False if one of that name exists already (an earlier master of
        the job made it; it is left as it is, and never read: the master has no ``get`` on Secrets)."""
        try:
            self._call(self._core.create_namespaced_secret, self.namespace, body)
        except ApiException as error:
            if error.status != 409:
                raise
            return False
        return True

    def add_secret_data(self, name: str, data: dict[str, str], deadline: float | None = None) -> None:
        """Add ``data`` (base64 values) to Secret ``name`` (a JSON merge patch: other keys stay); waits for
        the request budget until ``deadline`` (default: :data:`REQUEST_SECONDS` from now)."""
        self._call(
            self._core.patch_namespaced_secret,
            name,
            self.namespace,
            {"data": data},
            _content_type="application/merge-patch+json",
            deadline=deadline,
        )

    def delete_secret(self, name: str) -> None:
        """Delete Secret ``name``; one that is gone is fine."""
        try:
            self._call(self._core.delete_namespaced_secret, name, self.namespace)
        except ApiException as error:
            if error.status != 404:
                raise

    def delete_network_policy(self, name: str) -> None:
        """Delete NetworkPolicy ``name``; one that is gone is fine."""
        try:
            self._call(self._networking.delete_namespaced_network_policy, name, self.namespace)
        except ApiException as error:
            if error.status != 404:
                raise

    def pod_log_tail(self, name: str) -> list[str]:
        """The last :data:`LOG_TAIL_LINES` lines of pod ``name``'s ``main`` container; ``[]`` on any error
        (or no request budget within :data:`LOG_READ_SECONDS`)."""
        try:
            self.budget.acquire(time.monotonic() + LOG_READ_SECONDS)
            response = self._core.read_namespaced_pod_log(
                name,
                self.namespace,
                container=manifests.CONTAINER,
                tail_lines=LOG_TAIL_LINES,
                _preload_content=False,
                _request_timeout=LOG_READ_SECONDS,
            )
            text = response.data.decode("utf-8", errors="replace")
            response.release_conn()
        except (ApiException, *CONNECTION_ERRORS):
            return []
        return text.splitlines()[-LOG_TAIL_LINES:]

    def watch_pods(self, resource_version: str, seconds: int) -> Iterator[Json]:
        """The watch events (``{"type", "object"}``) of the job's pods after ``resource_version``, for up
        to ``seconds`` (the server ends the watch then). ERROR events are yielded like the others. Its start
        waits for the request budget for :data:`REQUEST_SECONDS` at most."""
        self.budget.acquire(time.monotonic() + REQUEST_SECONDS)
        response = self._core.list_namespaced_pod(
            self.namespace,
            label_selector=self.selector,
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=seconds,
            _preload_content=False,
            _request_timeout=(REQUEST_SECONDS, seconds + REQUEST_SECONDS),
        )
        with self._stream_lock:
            self._stream = response
        try:
            for line in iter_resp_lines(response):
                if line:
                    yield json.loads(line)
        finally:
            with self._stream_lock:
                self._stream = None
            response.release_conn()

    def interrupt_watch(self) -> None:
        """Make a :meth:`watch_pods` blocked in another thread end now."""
        with self._stream_lock:
            stream = self._stream
        if stream is not None:
            with contextlib.suppress(OSError, AttributeError):
                stream.shutdown()

    def _call(
        self, method: Callable[..., Any], *args: Any, deadline: float | None = None, **kwargs: Any
    ) -> Json:
        """One request through the client's ``method``, once the budget gives a token (waiting until
        ``deadline``, default :data:`REQUEST_SECONDS` from now); its answer's JSON."""
        self.budget.acquire(time.monotonic() + REQUEST_SECONDS if deadline is None else deadline)
        response = method(*args, _preload_content=False, _request_timeout=REQUEST_SECONDS, **kwargs)
        try:
            result: Json = json.loads(response.data)
        finally:
            response.release_conn()
        return result
