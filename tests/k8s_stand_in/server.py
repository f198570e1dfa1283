"""TEST-ONLY: the stand-in's HTTP front: the part of the Kubernetes REST API that edl-argo's master uses.

Routes (JSON; errors are ``Status`` objects with the real reasons and codes):

* ``/api/v1/namespaces/{ns}/{pods|services|secrets}``: POST (create), GET (list; ``labelSelector``;
  ``watch=true`` streams ``{"type", "object"}`` lines, chunked, from ``resourceVersion`` -- all current
  objects as ADDED when it is empty or 0 -- until ``timeoutSeconds`` or :attr:`KubernetesStandIn.
  watch_max_seconds`; a version older than the history gets an ERROR event with a 410 Status).
* ``.../{resource}/{name}``: GET, DELETE (``gracePeriodSeconds``, ``preconditions.uid``), PATCH (a JSON
  merge patch, ``application/merge-patch+json`` only);
  ``.../pods/{name}/status``: GET; ``.../pods/{name}/log``: GET (``tailLines``), text.
* ``/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies[/{name}]``: the same verbs; stored, not
  enforced.
* ``/apis/argoproj.io/v1alpha1/namespaces/{ns}/{workflows|workflowtemplates}[/{name}]`` and
  ``/api/v1/namespaces/{ns}/configmaps[/{name}]``: the same verbs, stored only, no behaviour.
* ``/apis/apps/v1/namespaces/{ns}/deployments[/{name}]``: the same verbs (PATCH of ``spec.replicas``
  scales); ``/apis/scheduling.k8s.io/v1/priorityclasses[/{name}]`` (cluster-scoped): the same verbs;
  ``/api/v1/nodes[/{name}]``: GET only.

PATCH takes ``application/merge-patch+json``, and ``application/strategic-merge-patch+json`` without lists
(where the two agree: e.g. ``{"spec": {"replicas": 3}}``, which the official client sends as a strategic
merge patch unless told ``_content_type``).

Every request is logged as an :class:`ApiCall` (the authorization verb and resource, as RBAC sees them,
its arrival time and its User-Agent): :meth:`KubernetesStandIn.arrivals` gives a client's arrival times, to
count its requests per second. :meth:`KubernetesStandIn.fail_for` answers 429, 500 or 503 for a while,
optionally with a ``Retry-After`` header.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlparse

from kubernetes import client as k8s

from tests.k8s_stand_in.cluster import CLUSTER_SCOPED, ApiError, Cluster
from tests.k8s_stand_in.scheduler import PREEMPT_LOWER_PRIORITY, StandInNode
from tests.k8s_stand_in.selectors import matches, parse_selector
from tests.k8s_stand_in.store import Gone, ObjectStore

_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))/(?:namespaces/(?P<ns>[^/]+)/)?"
    r"(?P<resource>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)
#: (API group, resource) -> kind.
KINDS = {
    ("", "pods"): "Pod",
    ("", "services"): "Service",
    ("", "secrets"): "Secret",
    ("", "configmaps"): "ConfigMap",
    ("", "nodes"): "Node",
    ("apps", "deployments"): "Deployment",
    ("scheduling.k8s.io", "priorityclasses"): "PriorityClass",
    ("networking.k8s.io", "networkpolicies"): "NetworkPolicy",
    ("argoproj.io", "workflows"): "Workflow",
    ("argoproj.io", "workflowtemplates"): "WorkflowTemplate",
}


@dataclass(frozen=True)
class ApiCall:
    """One request as an authorizer sees it: ``verb`` (get, list, watch, create, delete, ...), the API
    group, ``resource`` with its subresource (``pods/log``), and who asked (the User-Agent)."""

    time: float
    user_agent: str
    verb: str
    api_group: str
    resource: str
    namespace: str
    name: str
    status: int = 0


@dataclass
class _Failure:
    verb: str
    resource: str
    status: int
    message: str
    remaining: int


def rules_allow(rules: list[dict[str, Any]], call: ApiCall) -> bool:
    """Whether RBAC ``rules`` (a Role's) allow ``call``."""
    return any(
        (call.api_group in r.get("apiGroups", []) or "*" in r.get("apiGroups", []))
        and (call.resource in r.get("resources", []) or "*" in r.get("resources", []))
        and (call.verb in r.get("verbs", []) or "*" in r.get("verbs", []))
        for r in rules
    )


class KubernetesStandIn:
    """A stand-in Kubernetes API server on 127.0.0.1 whose pods run as local processes. TEST-ONLY.

    Use as a context manager. ``workdir`` holds the pods' logs and is their working directory (default: a
    temporary folder). ``echo_logs`` copies pod output to ``sys.stderr`` as ``[pod-name] line``. ``port``:
    where it listens (0: any free port); a client pointed at a port before the stand-in starts there sees
    refused connections, as while an API server restarts. :meth:`fail_requests` injects error answers.
    ``nodes``: the cluster's nodes and their capacity, which the scheduler places pods on by their requests
    (default: one node, ``stand-in-node``, with unlimited capacity: every pod is scheduled at once).
    ``require_priority_classes``: refuse (403) pods naming an unknown PriorityClass, as the API server does
    (default: only when ``nodes`` are given). ``run_processes=False``: bound pods are reported running
    without starting their command (thousands of pods fit; see :class:`~tests.k8s_stand_in.cluster.Cluster`).
    """

    def __init__(
        self,
        workdir: Path | None = None,
        *,
        echo_logs: bool = True,
        watch_max_seconds: float = 60.0,
        history: int = 10_000,
        port: int = 0,
        nodes: Sequence[StandInNode] | None = None,
        require_priority_classes: bool | None = None,
        run_processes: bool = True,
    ) -> None:
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="k8s-stand-in-")
        self.workdir = workdir if workdir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.store = ObjectStore(history)
        self.cluster = Cluster(
            self.store, self.workdir, echo_logs, nodes, require_priority_classes, run_processes
        )
        self.watch_max_seconds = watch_max_seconds
        self._calls: list[ApiCall] = []
        self._calls_lock = threading.Lock()
        self._rules: tuple[str, list[dict[str, Any]]] | None = None
        self._failures: list[_Failure] = []
        self._outage: tuple[float, tuple[int, ...], float | None] = (0.0, (), None)
        self._outage_answers = 0
        self._cut_generation = 0
        self._closing = False
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self._server.daemon_threads = True
        self._server.stand_in = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="k8s-stand-in", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def api_client(self, user_agent: str | None = None) -> k8s.ApiClient:
        """An official-client ApiClient for this server (the tests' own, unless ``user_agent`` says)."""
        configuration = k8s.Configuration()
        configuration.host = self.url
        api = k8s.ApiClient(configuration)
        if user_agent:
            api.user_agent = user_agent
        return api

    def close(self) -> None:
        self._closing = True
        self.store.expire_watches()
        try:
            self.cluster.close()
        finally:
            self._server.shutdown()
            self._server.server_close()
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> KubernetesStandIn:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- what tests look at and control ------------------------------------------------------------

    @property
    def calls(self) -> list[ApiCall]:
        with self._calls_lock:
            return list(self._calls)

    def enforce_rules(self, rules: list[dict[str, Any]], user_agent_prefix: str = "edl-argo/") -> None:
        """From now on, refuse (403) requests of clients whose User-Agent starts with the prefix unless
        ``rules`` (a Role's) allow them, as the API server does for a service account."""
        self._rules = (user_agent_prefix, rules)

    def fail_requests(self, verb: str, resource: str, status: int, message: str, count: int = 1) -> None:
        """Answer the next ``count`` ``verb`` requests on ``resource`` with ``status`` (e.g. 403 quota)."""
        self._failures.append(_Failure(verb, resource, status, message, count))

    def arrivals(self, user_agent_prefix: str = "", since: float = 0.0) -> list[float]:
        """The arrival times (``time.time()``) of the requests, watches included, whose User-Agent starts
        with ``user_agent_prefix``, from ``since`` on, in order."""
        return sorted(
            c.time for c in self.calls if c.user_agent.startswith(user_agent_prefix) and c.time >= since
        )

    def fail_for(
        self, seconds: float, statuses: tuple[int, ...] = (429, 500, 503), retry_after: float | None = None
    ) -> None:
        """Answer every request for ``seconds`` with one of ``statuses`` in turn (throttling, an API server
        in trouble), a 429 or 503 with header ``Retry-After: <retry_after>`` if given (whole seconds, as
        the API server sends it, rounded up); watches already open are cut (see :meth:`cut_watches`), new
        ones refused."""
        with self._calls_lock:
            self._outage = (time.monotonic() + seconds, statuses, retry_after)
        self.cut_watches()

    def cut_watches(self) -> None:
        """Break every open watch connection mid-stream: no final chunk, the socket is shut down (a
        proxy or load balancer dropping it). Combine with :meth:`store.compact <ObjectStore.compact>` to
        make the resumed watch get 410 Gone."""
        self._cut_generation += 1
        self.store.expire_watches()

    def clear_failures(self) -> None:
        """Forget the failures :meth:`fail_requests` still had to inject."""
        self._failures.clear()

    def hold_pending(self, selector: str = "", count: int | None = None) -> None:
        """New pods matching ``selector`` (the next ``count`` of them) stay Pending: no capacity."""
        self.cluster.hold_pending(selector, count)

    def release(self) -> None:
        """Capacity is back: held pods are scheduled and new ones no longer held."""
        self.cluster.release()

    def evict(self, name: str, namespace: str = "default") -> None:
        """Preempt pod ``name`` (DisruptionTarget condition, then graceful deletion)."""
        self.cluster.evict(namespace, name)

    def kill(self, name: str, sig: int, namespace: str = "default", *, oom: bool = False) -> None:
        """Signal pod ``name``'s processes; ``oom``: its exit is reported as OOMKilled."""
        self.cluster.signal(namespace, name, sig, oom)

    def expire_watches(self, compact: bool = True) -> None:
        """End every open watch; ``compact``: also forget the history, so resuming gets 410 Gone."""
        if compact:
            self.store.compact()
        self.store.expire_watches()

    def create(self, resource: str, body: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
        """Create an object directly (a Secret, a Workflow), as an administrator would (``namespace`` is
        ignored for the cluster-scoped ``nodes`` and ``priorityclasses``)."""
        return self.cluster.create(resource, namespace, body)

    def add_node(self, node: StandInNode) -> dict[str, Any]:
        """Add a node (capacity joins the cluster: pending pods that fit there are scheduled)."""
        return self.cluster.add_node(node)

    def create_priority_class(
        self,
        name: str,
        value: int,
        *,
        global_default: bool = False,
        preemption_policy: str = PREEMPT_LOWER_PRIORITY,
    ) -> dict[str, Any]:
        """Create PriorityClass ``name`` (scheduling.k8s.io/v1) with priority ``value``; ``global_default``:
        the priority of pods naming no class; ``preemption_policy``: ``PreemptLowerPriority`` or ``Never``."""
        body = {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": name},
            "value": value,
            "globalDefault": global_default,
            "preemptionPolicy": preemption_policy,
        }
        return self.cluster.create("priorityclasses", "", body)

    def create_deployment(
        self, name: str, pod_spec: dict[str, Any], replicas: int = 1, namespace: str = "default"
    ) -> dict[str, Any]:
        """Create Deployment ``name`` (apps/v1) keeping ``replicas`` pods of ``pod_spec``, labelled
        ``app: <name>`` (its selector)."""
        labels = {"app": name}
        body = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        }
        return self.cluster.create("deployments", namespace, body)

    def scale_deployment(self, name: str, replicas: int, namespace: str = "default") -> dict[str, Any]:
        """Set Deployment ``name``'s ``spec.replicas`` (as ``kubectl scale`` does); its controller adds or
        deletes pods."""
        return self.cluster.merge_patch("deployments", namespace, name, {"spec": {"replicas": replicas}})

    def mount_secret(self, name: str, folder: Path, namespace: str = "default") -> Path:
        """``folder`` as a pod starting now would see an optional volume of Secret ``name`` (the kubelet's
        part: see :meth:`Cluster.secret_volume`); returns ``folder``."""
        self.cluster.secret_volume(namespace, name, folder)
        return folder

    def delete(self, resource: str, name: str, namespace: str = "default") -> None:
        self.cluster.delete(resource, namespace, name)

    def objects(self, resource: str, selector: str = "", namespace: str = "default") -> list[dict[str, Any]]:
        return self.cluster.list(resource, namespace, selector)[0]

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        try:
            return self.cluster.read("pods", namespace, name)
        except ApiError:
            return None

    def wait_for(
        self, condition: Callable[[], object], timeout: float = 20.0, what: str = "condition"
    ) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.02)

    # -- request handling --------------------------------------------------------------------------

    def _handle(self, handler: _Handler, method: str) -> None:
        url = urlparse(handler.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(handler.headers.get("Content-Length") or 0)
        body = json.loads(handler.rfile.read(length) or b"{}") if length else {}
        m = _PATH.match(url.path)
        if m is None:
            _send_status(handler, ApiError(404, "NotFound", f"the server could not find {url.path}"))
            return
        group, resource, name, sub = m["group"] or "", m["resource"], m["name"] or "", m["sub"] or ""
        namespace = m["ns"] or ""
        watch = query.get("watch", "").lower() in ("true", "1")
        verb = _verb(method, bool(name), watch)
        call = ApiCall(
            time.time(),
            handler.headers.get("User-Agent", ""),
            verb,
            group,
            f"{resource}/{sub}" if sub else resource,
            namespace,
            name,
        )
        try:
            self._admit(call)
            if (group, resource) not in KINDS or (resource in CLUSTER_SCOPED) == bool(namespace):
                raise ApiError(
                    404, "NotFound", f"the server could not find the requested resource {resource}"
                )
            if watch:
                self._log(call, 200)
                self._watch(handler, resource, namespace, query)
                return
            content_type = (handler.headers.get("Content-Type") or "").split(";")[0].strip()
            code, answer = self._serve(
                method, resource, namespace, name, sub, query, body, group, content_type
            )
        except ApiError as error:
            self._log(call, error.code)
            _send_status(handler, error)
            return
        self._log(call, code)
        if isinstance(answer, str):
            _send(handler, code, answer.encode(), "text/plain")
        else:
            _send(handler, code, json.dumps(answer).encode(), "application/json")

    def _admit(self, call: ApiCall) -> None:
        if self._rules is not None:
            prefix, rules = self._rules
            if call.user_agent.startswith(prefix) and not rules_allow(rules, call):
                raise ApiError(
                    403, "Forbidden", f'User "edl-argo-master" cannot {call.verb} resource "{call.resource}"'
                )
        with self._calls_lock:
            until, statuses, retry_after = self._outage
            if statuses and time.monotonic() < until:
                self._outage_answers += 1
                status = statuses[self._outage_answers % len(statuses)]
                reason = "TooManyRequests" if status == 429 else "InternalError"
                after = retry_after if status in (429, 503) else None
                raise ApiError(status, reason, f"stand-in: API server unavailable ({status})", after)
        for failure in self._failures:
            if failure.remaining > 0 and failure.verb == call.verb and failure.resource == call.resource:
                failure.remaining -= 1
                raise ApiError(
                    failure.status, "Forbidden" if failure.status == 403 else "Failure", failure.message
                )

    def _serve(
        self,
        method: str,
        resource: str,
        namespace: str,
        name: str,
        sub: str,
        query: dict[str, str],
        body: dict[str, Any],
        group: str,
        content_type: str = "",
    ) -> tuple[int, dict[str, Any] | str]:
        kind = KINDS[(group, resource)]
        typed = {"kind": kind, "apiVersion": f"{group}/v1" if group else "v1"}
        if resource == "nodes" and method != "GET":
            raise ApiError(405, "MethodNotAllowed", "the stand-in's nodes are its own (see add_node)")
        if method == "POST" and not name:
            return 201, self.cluster.create(resource, namespace, body)
        if method == "GET" and not name:
            items, revision = self.cluster.list(resource, namespace, query.get("labelSelector"))
            for item in items:
                item.setdefault("kind", kind)
            meta = {"resourceVersion": str(revision)}
            return 200, typed | {"kind": f"{kind}List", "metadata": meta, "items": items}
        if method == "GET" and resource == "pods" and sub == "log":
            tail = int(query["tailLines"]) if "tailLines" in query else None
            return 200, self.cluster.pod_log(namespace, name, tail)
        if method == "GET" and sub in ("", "status"):
            return 200, typed | self.cluster.read(resource, namespace, name)
        if method == "PATCH" and name and not sub:
            if not _merges(content_type, body):
                raise ApiError(415, "UnsupportedMediaType", f"the stand-in merges only, not {content_type}")
            return 200, typed | self.cluster.merge_patch(resource, namespace, name, body)
        if method == "DELETE" and name and not sub:
            grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
            uid = (body.get("preconditions") or {}).get("uid")
            deleted = self.cluster.delete(
                resource, namespace, name, None if grace is None else int(grace), uid
            )
            return 200, typed | deleted
        raise ApiError(405, "MethodNotAllowed", f"{method} {resource}/{sub} is not supported by the stand-in")

    def _watch(self, handler: _Handler, resource: str, namespace: str, query: dict[str, str]) -> None:
        selector = parse_selector(query.get("labelSelector"))
        timeout = min(float(query.get("timeoutSeconds") or self.watch_max_seconds), self.watch_max_seconds)
        deadline = time.monotonic() + timeout
        generation = self.store.watch_generation
        cut = self._cut_generation
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        version = query.get("resourceVersion") or "0"
        with self.store.lock:
            if version == "0":
                items, cursor = self.store.list(resource, namespace, selector)
                initial = [{"type": "ADDED", "object": item} for item in items]
            else:
                cursor, initial = int(version), []
        try:
            for event in initial:
                _chunk(handler, event)
            while not self._closing:
                with self.store.changed:
                    if self.store.watch_generation != generation:
                        break
                    try:
                        events = self.store.events_after(cursor)
                    except Gone as error:
                        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
                        status |= {"message": str(error), "reason": "Expired", "code": 410}
                        events, gone = [], status
                    else:
                        gone = None
                    if not events and gone is None:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self.store.changed.wait(min(remaining, 1.0))
                        continue
                if gone is not None:
                    _chunk(handler, {"type": "ERROR", "object": gone})
                    break
                for event in events:
                    cursor = event.resource_version
                    if (
                        event.resource == resource
                        and event.namespace == namespace
                        and matches(selector, event.obj["metadata"].get("labels"))
                    ):
                        _chunk(handler, {"type": event.type, "object": event.obj})
                if time.monotonic() > deadline:
                    break
            if self._cut_generation != cut:  # dropped mid-stream: no final chunk
                handler.close_connection = True
                with contextlib.suppress(OSError):
                    handler.connection.shutdown(socket.SHUT_RDWR)
                return
            handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            handler.close_connection = True

    def _log(self, call: ApiCall, status: int) -> None:
        with self._calls_lock:
            self._calls.append(ApiCall(**{**call.__dict__, "status": status}))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _dispatch(self, method: str) -> None:
        self.server.stand_in._handle(self, method)  # type: ignore[attr-defined]

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _verb(method: str, named: bool, watch: bool) -> str:
    if method == "GET":
        return "watch" if watch else "get" if named else "list"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(
        method, "delete" if named else "deletecollection"
    )


def _merges(content_type: str, patch: Any) -> bool:
    """Whether a PATCH of ``content_type`` is a JSON merge patch: declared so, or a strategic merge patch
    without lists (for maps and scalars the two agree; lists have merge keys, which the stand-in lacks)."""
    if content_type == "application/merge-patch+json":
        return True
    return content_type == "application/strategic-merge-patch+json" and not _has_list(patch)


def _has_list(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_list(item) for item in value.values())
    return isinstance(value, list)


def _send(
    handler: BaseHTTPRequestHandler,
    code: int,
    data: bytes,
    content_type: str,
    headers: dict[str, str] | None = None,
) -> None:
    handler.send_response(code)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(data)


def _send_status(handler: BaseHTTPRequestHandler, error: ApiError) -> None:
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": error.message,
        "reason": error.reason,
        "code": error.code,
    }
    headers = {} if error.retry_after is None else {"Retry-After": str(math.ceil(error.retry_after))}
    _send(handler, error.code, json.dumps(status).encode(), "application/json", headers)


def _chunk(handler: BaseHTTPRequestHandler, event: dict[str, Any]) -> None:
    data = json.dumps(event).encode() + b"\n"
    handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    handler.wfile.flush()
