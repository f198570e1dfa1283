"""TEST-ONLY: what the stand-in's API server, scheduler, kubelet and controllers do to objects.

Resources: ``pods``, ``services``, ``secrets`` (core/v1), ``networkpolicies`` (networking.k8s.io/v1,
stored and checked for shape, not enforced: pods share the loopback address), ``workflows``
(argoproj.io/v1alpha1, stored only so that owner references to a Workflow cascade), and ``configmaps`` and
``workflowtemplates`` (argoproj.io/v1alpha1), stored only; ``deployments`` (apps/v1, see
:mod:`~tests.k8s_stand_in.deployments`); cluster-scoped (stored under namespace ''): ``nodes`` (core/v1,
made by :meth:`Cluster.add_node`) and ``priorityclasses`` (scheduling.k8s.io/v1). Each node runs its pods'
containers as local process groups (``command`` + ``args``, ``edl-argo`` resolved to this interpreter's
console script) with ``status.podIP`` 127.0.0.1, so pods share the loopback address; with
``run_processes=False`` a bound pod's container is reported running and no process is started (a pod then
costs a few kilobytes, so thousands fit: scale tests). By default there is one node, ``stand-in-node``, of
unlimited capacity.

Admission: an object whose labels the API server would refuse (a value over 63 characters, ...) is
refused with 422 Invalid, on create and on patch; a pod with a malformed cpu or memory quantity too. A pod
gets ``spec.priority`` and ``spec.preemptionPolicy`` from the PriorityClass it names (none: the
globalDefault class, else 0), as the Priority admission plugin sets them; an unknown class is refused
(403) when :attr:`Cluster.require_priority_classes` (by default, when the cluster was given nodes).

Scheduling (:mod:`~tests.k8s_stand_in.scheduler` has the rules): one controller thread runs a pass
whenever the store changes (so within milliseconds of capacity freeing: a pod terminated or removed, a node
added, a hold released) and every 2 s anyway: the Deployment controller, then the scheduler, which binds
the pending pods that fit (``spec.nodeName``) in queue order, preempts for those that fit nowhere (victims
get ``DisruptionTarget=True``/``PreemptionByScheduler`` and a graceful delete, the preemptor
``status.nominatedNodeName``), and marks the others ``PodScheduled=False``/``Unschedulable`` with
kube-scheduler's message. A pass writes only what changes, so a pending pod's watchers see one event per
change.

Pod lifecycle: created Pending -> scheduled (unless held: then PodScheduled=False/Unschedulable until
:meth:`Cluster.release`; or left Pending while nothing fits) -> Running once its process started (or
Pending with a waiting container: ``InvalidImageName`` for an image name with upper-case letters or spaces,
``CreateContainerConfigError`` for a missing, non-optional Secret) -> Succeeded (exit 0) or Failed, the
container's ``terminated`` state holding the exit status (128+N for signal N) and reason ``Completed``,
``Error`` or ``OOMKilled`` (see :meth:`Cluster.signal`). A pod holds its node's resources until it has
terminated. Deleting a running pod is graceful: MODIFIED with ``deletionTimestamp``, SIGTERM, SIGKILL after
the grace period, the terminal status (MODIFIED), then DELETED; a pod without a running process goes at
once (MODIFIED, then DELETED). When an object goes, the objects whose ownerReferences name its uid are
deleted too (background cascade).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tests.k8s_stand_in.deployments import DeploymentController, deployment_problems
from tests.k8s_stand_in.errors import ApiError
from tests.k8s_stand_in.forked import ForkedProcess, start_forked
from tests.k8s_stand_in.scheduler import (
    Bind,
    PodView,
    Preempt,
    StandInNode,
    Unschedulable,
    admitted_priority,
    holds_resources,
    plan,
    pod_requests,
    priority_class_problems,
)
from tests.k8s_stand_in.selectors import Requirement, label_problems, matches, parse_selector
from tests.k8s_stand_in.store import ObjectKey, ObjectStore

#: The node of a stand-in built without ``nodes``: unlimited capacity.
NODE = "stand-in-node"
#: Resources without a namespace (their objects are stored with namespace '').
CLUSTER_SCOPED = frozenset({"nodes", "priorityclasses"})
#: The controllers also run this often when nothing changes (a safety net: they are event-driven).
_SAFETY_RETRY_SECONDS = 2.0
#: How long :meth:`Cluster.close` waits for each pod's processes to end after their SIGKILL.
CLOSE_WAIT_SECONDS = 30.0
_PREEMPTION_MESSAGE = "default-scheduler: preempting to accommodate a higher priority pod"
POD_IP = "127.0.0.1"
#: Environment variables of the test process that a pod does not inherit (a container would not have them).
_PRIVATE_ENV = re.compile(r"^(AWS_|EDL_|POD_IP$|KUBE|KUBERNETES_|PYTEST_)")
_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:@-]*$")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(eq=False)
class _Container:
    """The running process of one pod's (single) container."""

    key: ObjectKey
    uid: str
    process: subprocess.Popen[bytes] | ForkedProcess
    log_path: Path
    started_at: str
    oom: bool = False
    kill_deadline: float = float("inf")
    threads: list[threading.Thread] = field(default_factory=list)


@dataclass
class _Hold:
    selector: list[Requirement]
    remaining: int | None


def now_rfc3339(at: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if at is None else at))


class Cluster:
    """The objects of a stand-in cluster and what happens to them. Thread-safe (one lock: the store's).

    ``nodes``: the cluster's nodes (default: one, :data:`NODE`, with unlimited capacity).
    ``require_priority_classes``: refuse (403) a pod naming an unknown PriorityClass, as the API server
    does; by default only when ``nodes`` are given (without, such a pod gets priority 0, so that tests
    need not create the classes their pods name). ``run_processes``: start each bound pod's command as a
    process (default); False: report it running without one (it runs until deleted, which is at once).
    """

    def __init__(
        self,
        store: ObjectStore,
        workdir: Path,
        echo_logs: bool = True,
        nodes: Sequence[StandInNode] | None = None,
        require_priority_classes: bool | None = None,
        run_processes: bool = True,
    ) -> None:
        self.store = store
        self.run_processes = run_processes
        self.workdir = workdir
        self.echo_logs = echo_logs
        #: Also called with every pod output line, as ``[pod-name] line`` (a chaos trial's log).
        self.log_sink: Callable[[str], object] | None = None
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        self._containers: dict[str, _Container] = {}
        self._holds: list[_Hold] = []
        #: The uids of the pods held Pending by :meth:`hold_pending`.
        self._held: set[str] = set()
        #: Pod uid -> creation order (the scheduling queue's tie break).
        self._arrivals: dict[str, int] = {}
        self._arrival_counter = itertools.count()
        self.require_priority_classes = (
            nodes is not None if require_priority_classes is None else require_priority_classes
        )
        self._closed = False
        self._wake_requested = False
        for node in nodes if nodes is not None else [StandInNode(NODE)]:
            self.add_node(node)
        self._deployments = DeploymentController(self)
        self._controllers = threading.Thread(target=self._run_controllers, name="k8s-stand-in-controllers")
        self._controllers.daemon = True
        self._controllers.start()

    # -- the API ---------------------------------------------------------------------------------

    def create(self, resource: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        namespace = _scope(resource, namespace)
        meta = body.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", f"{resource}: metadata.name: Required value")
        key = (resource, namespace, name)
        _check_labels(resource, name, meta)
        with self.store.lock:
            if self.store.get(key) is not None:
                raise ApiError(409, "AlreadyExists", f'{resource} "{name}" already exists')
            meta.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339())
            getattr(self, f"_admit_{resource}", lambda _body: None)(body)
            created = self.store.put(key, body, "ADDED")
            if resource == "pods":
                self._arrivals[meta["uid"]] = next(self._arrival_counter)
                self._hold_if_asked(key, body)
        return created

    def read(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        namespace = _scope(resource, namespace)
        with self.store.lock:
            obj = self.store.get((resource, namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            return _copy(obj)

    def list(self, resource: str, namespace: str, selector: str | None) -> tuple[list[dict[str, Any]], int]:
        try:
            requirements = parse_selector(selector)
        except ValueError as error:
            raise ApiError(400, "BadRequest", str(error)) from None
        return self.store.list(resource, _scope(resource, namespace), requirements)

    def delete(
        self, resource: str, namespace: str, name: str, grace: int | None = None, uid: str | None = None
    ) -> dict[str, Any]:
        """Delete an object (``uid``: only if it is that one, else 409), gracefully for a running pod."""
        key = (resource, _scope(resource, namespace), name)
        with self.store.lock:
            obj = self.store.get(key)
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            actual = obj["metadata"]["uid"]
            if uid and actual != uid:
                message = f"Precondition failed: UID in precondition: {uid}, UID in object meta: {actual}"
                raise ApiError(409, "Conflict", message)
            if resource == "pods":
                return self._delete_pod(key, obj, grace)
            return self._remove(key) or {}

    def merge_patch(self, resource: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Apply a JSON merge patch (RFC 7386: maps merge, ``null`` removes a key) to an object."""
        key = (resource, _scope(resource, namespace), name)
        with self.store.lock:
            obj = self.store.get(key)
            if obj is None:
                raise ApiError(404, "NotFound", f'{resource} "{name}" not found')
            patched = _merged(_copy(obj), patch)
            _check_labels(resource, name, patched["metadata"])
            if resource == "deployments":
                _refuse_problems(resource, name, deployment_problems(patched))
            return self.store.put(key, patched, "MODIFIED")

    def pod_log(self, namespace: str, name: str, tail_lines: int | None) -> str:
        pod = self.read("pods", namespace, name)
        path = self._log_path(namespace, name, pod["metadata"]["uid"])
        if not path.exists():
            raise ApiError(400, "BadRequest", f'container "main" in pod "{name}" is waiting to start')
        lines = path.read_text(errors="replace").splitlines(keepends=True)
        return "".join(lines[-tail_lines:] if tail_lines else lines)

    def secret_volume(self, namespace: str, name: str, folder: Path, mode: int = 0o440) -> None:
        """Fill ``folder`` as the kubelet fills an optional Secret volume when a pod starts: one file per key
        of Secret ``name`` (decoded, ``mode``), or nothing when there is no such Secret."""
        folder.mkdir(parents=True, exist_ok=True)
        secret = self.store.get(("secrets", namespace, name))
        for key, encoded in ((secret or {}).get("data") or {}).items():
            path = folder / key
            path.write_bytes(base64.b64decode(encoded))
            path.chmod(mode)

    # -- test controls ---------------------------------------------------------------------------

    def hold_pending(self, selector: str = "", count: int | None = None) -> None:
        """Keep the next ``count`` (default: all) new pods matching ``selector`` Pending/Unschedulable."""
        with self.store.lock:
            self._holds.append(_Hold(parse_selector(selector), count))

    def release(self) -> None:
        """Drop every hold; the pods held so far go back to the scheduling queue (capacity freed up): with
        room for them, they are scheduled in queue order (priority, then the oldest first)."""
        with self.store.lock:
            self._holds.clear()
            self._held.clear()
            self._wake_controllers()

    def evict(
        self,
        namespace: str,
        name: str,
        reason: str = "PreemptionByScheduler",
        message: str = "stand-in: preempted to make room",
    ) -> None:
        """Preempt a pod as the scheduler does: a DisruptionTarget condition, then graceful deletion."""
        key = ("pods", namespace, name)
        with self.store.lock:
            pod = self.store.get(key)
            if pod is None:
                raise KeyError(name)
            _set_condition(pod, "DisruptionTarget", "True", reason, message)
            self.store.put(key, pod, "MODIFIED")
            self._delete_pod(key, pod, None)

    def add_node(self, node: StandInNode) -> dict[str, Any]:
        """Add a node to the cluster (pending pods that fit there are scheduled); returns its Node object."""
        with self.store.lock:
            key = ("nodes", "", node.name)
            if self.store.get(key) is not None:
                raise ApiError(409, "AlreadyExists", f'nodes "{node.name}" already exists')
            manifest = node.manifest(POD_IP)
            manifest["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339())
            return self.store.put(key, manifest, "ADDED")

    def creation_order(self, pod: Mapping[str, Any]) -> int:
        """The rank of ``pod`` among the pods created in this cluster (0: the first)."""
        return self._arrivals.get(pod["metadata"]["uid"], -1)

    def signal(self, namespace: str, name: str, sig: int, oom: bool = False) -> None:
        """Send ``sig`` to a running pod's processes (``oom``: report the exit as OOMKilled)."""
        with self.store.lock:
            pod = self.store.get(("pods", namespace, name))
            container = self._containers.get(pod["metadata"]["uid"]) if pod else None
            if container is None:
                raise KeyError(f"pod {name} is not running")
            container.oom = container.oom or oom
            _signal_group(container.process.pid, sig)

    def close(self) -> None:
        """Stop the controllers, SIGKILL every pod's processes and wait for them, at most
        :data:`CLOSE_WAIT_SECONDS` in all: RuntimeError names the pods still running then."""
        with self.store.lock:
            self._closed = True
            self._wake_controllers()
            containers = list(self._containers.values())
        for container in containers:
            _signal_group(container.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        stuck = []
        for container in containers:
            try:
                container.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stuck.append(container.key[2])
        if stuck:
            raise RuntimeError(
                f"stand-in pods {', '.join(stuck)} did not end within {CLOSE_WAIT_SECONDS:g} s "
                "of their SIGKILL"
            )

    # -- admission -------------------------------------------------------------------------------

    def _admit_pods(self, pod: dict[str, Any]) -> None:
        """Validate, then resolve the pod's priority as the Priority admission plugin does."""
        spec, name = pod.get("spec") or {}, pod["metadata"]["name"]
        containers = spec.get("containers") or []
        if not containers or not all(c.get("name") and c.get("image") for c in containers):
            raise ApiError(422, "Invalid", "spec.containers: each needs a name and an image")
        try:
            pod_requests(pod)
        except ValueError as error:
            raise ApiError(422, "Invalid", f'pods "{name}" is invalid: {error}') from None
        classes = [c for _, c in self.store.items("priorityclasses")]
        try:
            class_name, priority, policy = admitted_priority(
                name, spec.get("priorityClassName", ""), classes, require_class=self.require_priority_classes
            )
        except PermissionError as error:
            raise ApiError(403, "Forbidden", str(error)) from None
        if class_name:
            spec["priorityClassName"] = class_name
        spec.update(priority=priority, preemptionPolicy=policy)
        pod["status"] = {"phase": "Pending", "conditions": []}

    def _admit_priorityclasses(self, priority_class: dict[str, Any]) -> None:
        others = [c for _, c in self.store.items("priorityclasses")]
        _refuse_problems(
            "priorityclasses",
            priority_class["metadata"]["name"],
            priority_class_problems(priority_class, others),
        )

    def _admit_deployments(self, deployment: dict[str, Any]) -> None:
        _refuse_problems("deployments", deployment["metadata"]["name"], deployment_problems(deployment))
        deployment["spec"].setdefault("replicas", 1)
        deployment["status"] = {}

    def _admit_services(self, service: dict[str, Any]) -> None:
        spec = service.setdefault("spec", {})
        if not spec.get("ports"):
            raise ApiError(422, "Invalid", "spec.ports: Required value")
        if spec.get("clusterIP") != "None":
            spec["clusterIP"] = POD_IP
            spec["clusterIPs"] = [POD_IP]

    def _admit_networkpolicies(self, policy: dict[str, Any]) -> None:
        spec = policy.get("spec") or {}
        if not isinstance(spec.get("podSelector"), dict):
            raise ApiError(422, "Invalid", "spec.podSelector: Required value")
        for rule in spec.get("ingress") or []:
            for port in rule.get("ports") or []:
                if port.get("protocol", "TCP") not in ("TCP", "UDP", "SCTP") or not port.get("port"):
                    raise ApiError(422, "Invalid", f"spec.ingress.ports: invalid port {port}")

    def _admit_secrets(self, secret: dict[str, Any]) -> None:
        data = secret.setdefault("data", {})
        for key, value in (secret.pop("stringData", None) or {}).items():
            data[key] = base64.b64encode(value.encode()).decode()

    # -- controllers, scheduler and kubelet -------------------------------------------------------

    def _hold_if_asked(self, key: ObjectKey, pod: dict[str, Any]) -> None:
        """Keep a new pod out of the scheduling queue if a hold (:meth:`hold_pending`) selects it."""
        hold = next((h for h in self._holds if matches(h.selector, pod["metadata"].get("labels"))), None)
        if hold is None:
            return
        if hold.remaining is not None:
            hold.remaining -= 1
            if hold.remaining <= 0:
                self._holds.remove(hold)
        self._held.add(pod["metadata"]["uid"])
        message = "0/1 nodes are available: 1 Insufficient cpu. (held by the stand-in)"
        _set_condition(pod, "PodScheduled", "False", "Unschedulable", message)
        self.store.put(key, pod, "MODIFIED")

    def _wake_controllers(self) -> None:
        """Have the controllers run now though the store did not change. Called with the lock held."""
        self._wake_requested = True
        self.store.changed.notify_all()

    def _run_controllers(self) -> None:
        """The controller thread: the Deployment controller, then a scheduling pass, each time the store
        changes (or :meth:`_wake_controllers`), and every :data:`_SAFETY_RETRY_SECONDS` anyway. A pass writes
        only what changes, so the passes its own writes trigger end quietly."""
        with self.store.changed:
            while not self._closed:
                self._wake_requested = False
                seen = self.store.revision  # before the pass: what it writes is a change to react to
                try:
                    self._deployments.reconcile()
                    self._schedule_pending()
                except Exception:  # a bug here must show, and not stop every later pass
                    traceback.print_exc()
                self.store.changed.wait_for(
                    lambda: self._closed or self._wake_requested or self.store.revision != seen,  # noqa: B023
                    _SAFETY_RETRY_SECONDS,
                )

    def _schedule_pending(self) -> None:
        """One scheduling pass (:func:`~tests.k8s_stand_in.scheduler.plan`) over the pods not bound, not
        being deleted and not held, carried out. Called with the lock held."""
        pending: dict[str, tuple[ObjectKey, dict[str, Any]]] = {}
        views, placed = [], []
        for key, pod in self.store.items("pods"):
            meta = pod["metadata"]
            if holds_resources(pod):
                placed.append(PodView.of(pod, self.creation_order(pod)))
            elif not (
                pod["spec"].get("nodeName") or meta.get("deletionTimestamp") or meta["uid"] in self._held
            ):
                pending[meta["uid"]] = (key, pod)
                views.append(PodView.of(pod, self.creation_order(pod)))
        nodes = [node for _, node in self.store.items("nodes")]
        for decision in plan(views, placed, nodes):
            key, pod = pending[decision.pod.uid]
            match decision:
                case Bind(node=node):
                    self._bind(key, pod, node)
                case Preempt(node=node, victims=victims, message=message):
                    for victim in victims:
                        self.evict(victim.namespace, victim.name, message=_PREEMPTION_MESSAGE)
                    self._mark_unschedulable(key, pod, message, node)
                case Unschedulable(message=message):
                    self._mark_unschedulable(key, pod, message, None)

    def _mark_unschedulable(
        self, key: ObjectKey, pod: dict[str, Any], message: str, nominated_node: str | None
    ) -> None:
        """PodScheduled=False/Unschedulable with ``message``, and ``status.nominatedNodeName``: written only
        if that changes them (a pending pod's watchers see one event per change, not one per pass)."""
        status = pod["status"]
        scheduled = next((c for c in status["conditions"] if c["type"] == "PodScheduled"), {})
        changed = False
        if (scheduled.get("status"), scheduled.get("reason"), scheduled.get("message")) != (
            "False",
            "Unschedulable",
            message,
        ):
            _set_condition(pod, "PodScheduled", "False", "Unschedulable", message)
            changed = True
        if status.get("nominatedNodeName") != nominated_node:
            if nominated_node:
                status["nominatedNodeName"] = nominated_node
            else:
                status.pop("nominatedNodeName")
            changed = True
        if changed:
            self.store.put(key, pod, "MODIFIED")

    def _bind(self, key: ObjectKey, pod: dict[str, Any], node: str) -> None:
        """Put ``pod`` on ``node`` and start its container. Called with the lock held."""
        pod["spec"]["nodeName"] = node
        _set_condition(pod, "PodScheduled", "True", "", "")
        status = pod["status"]
        container = pod["spec"]["containers"][0]
        try:
            if not _IMAGE.match(container["image"]):
                raise ApiError(
                    400, "InvalidImageName", f'Failed to apply default image tag "{container["image"]}"'
                )
            env = self._container_env(pod, container)
        except ApiError as error:
            status["containerStatuses"] = [
                _container_status(container, {"waiting": {"reason": error.reason, "message": error.message}})
            ]
            self.store.put(key, pod, "MODIFIED")
            return
        command = [_VAR_REF.sub(lambda m: env.get(m[1], m[0]), arg) for arg in _argv(container)]
        if not self.run_processes:
            self._report_running(key, pod, now_rfc3339())
            return
        uid = pod["metadata"]["uid"]
        log_path = self._log_path(key[1], key[2], uid)
        argv = [_resolve_program(command[0]), *command[1:]]
        process: subprocess.Popen[bytes] | ForkedProcess | None
        try:
            process = start_forked(argv, env, self.workdir, self.workdir / "forked" / uid, _base_env())
            if process is None:
                process = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=self.workdir,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as error:
            state = {"waiting": {"reason": "RunContainerError", "message": str(error)}}
            status["containerStatuses"] = [_container_status(container, state)]
            self.store.put(key, pod, "MODIFIED")
            return
        started = now_rfc3339()
        running = _Container(key, uid, process, log_path, started)
        self._containers[uid] = running
        self._report_running(key, pod, started)
        assert process.stdout is not None
        for target, args in ((self._copy_log, (running, process.stdout)), (self._wait, (running,))):
            thread = threading.Thread(target=target, args=args, daemon=True)
            running.threads.append(thread)
            thread.start()

    def _report_running(self, key: ObjectKey, pod: dict[str, Any], started: str) -> None:
        """Write ``pod``'s status as its container runs since ``started``. Called with the lock held."""
        status = pod["status"]
        status.update(
            phase="Running", podIP=POD_IP, podIPs=[{"ip": POD_IP}], hostIP=POD_IP, startTime=started
        )
        container = pod["spec"]["containers"][0]
        status["containerStatuses"] = [
            _container_status(container, {"running": {"startedAt": started}}, ready=True, started=True)
        ]
        _set_condition(pod, "Ready", "True", "", "")
        self.store.put(key, pod, "MODIFIED")

    def _container_env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        """The container's environment: the test process's (minus private variables), then ``env``."""
        env = _base_env()
        env["HOSTNAME"] = pod["metadata"]["name"]
        for item in container.get("env") or []:
            name = item["name"]
            if "value" in item:
                env[name] = _VAR_REF.sub(lambda m: env.get(m[1], m[0]), str(item["value"]))
                continue
            source = item.get("valueFrom") or {}
            if "fieldRef" in source:
                env[name] = _field(pod, source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source:
                value = self._secret_value(pod["metadata"]["namespace"], source["secretKeyRef"])
                if value is not None:
                    env[name] = value
            else:
                raise ApiError(400, "CreateContainerConfigError", f"unsupported valueFrom for {name}")
        return env

    def _secret_value(self, namespace: str, ref: Mapping[str, Any]) -> str | None:
        secret = self.store.get(("secrets", namespace, ref["name"]))
        optional = bool(ref.get("optional"))
        if secret is None:
            if optional:
                return None
            raise ApiError(400, "CreateContainerConfigError", f'secret "{ref["name"]}" not found')
        encoded = (secret.get("data") or {}).get(ref["key"])
        if encoded is None:
            if optional:
                return None
            raise ApiError(
                400,
                "CreateContainerConfigError",
                f"couldn't find key {ref['key']} in Secret {namespace}/{ref['name']}",
            )
        return base64.b64decode(encoded).decode()

    def _copy_log(self, container: _Container, stream: IO[bytes]) -> None:
        prefix = f"[{container.key[2]}] "
        with stream, container.log_path.open("ab") as log:
            for line in iter(stream.readline, b""):
                log.write(line)
                log.flush()
                sink = self.log_sink
                if sink is not None:
                    sink(prefix + line.decode("utf-8", errors="replace").rstrip("\n") + "\n")
                if self.echo_logs:
                    with contextlib.suppress(OSError, ValueError):
                        sys.stderr.write(prefix + line.decode("utf-8", errors="replace").rstrip("\n") + "\n")
                        sys.stderr.flush()

    def _wait(self, container: _Container) -> None:
        returncode = container.process.wait()
        _signal_group(container.process.pid, signal.SIGKILL)  # what the main process left behind
        container.threads[0].join(2.0)
        exit_code = returncode if returncode >= 0 else 128 - returncode
        with self.store.lock:
            self._containers.pop(container.uid, None)
            pod = self.store.get(container.key)
            if pod is None or pod["metadata"]["uid"] != container.uid:
                return
            reason = "OOMKilled" if container.oom else "Completed" if exit_code == 0 else "Error"
            terminated = {
                "exitCode": exit_code,
                "reason": reason,
                "startedAt": container.started_at,
                "finishedAt": now_rfc3339(),
            }
            spec = pod["spec"]["containers"][0]
            pod["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
            pod["status"]["containerStatuses"] = [_container_status(spec, {"terminated": terminated})]
            _set_condition(pod, "Ready", "False", "PodCompleted", "")
            self.store.put(container.key, pod, "MODIFIED")
            if pod["metadata"].get("deletionTimestamp"):
                self._remove(container.key)

    # -- deletion --------------------------------------------------------------------------------

    def _delete_pod(self, key: ObjectKey, pod: dict[str, Any], grace: int | None) -> dict[str, Any]:
        """Called with the lock held."""
        meta = pod["metadata"]
        if grace is None:
            grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        container = self._containers.get(meta["uid"])
        if container is None:  # nothing runs: the object goes at once
            meta.setdefault("deletionTimestamp", now_rfc3339())
            meta["deletionGracePeriodSeconds"] = 0
            self.store.put(key, pod, "MODIFIED")
            self._held.discard(meta["uid"])
            return self._remove(key) or {}
        deadline = time.monotonic() + grace
        if deadline < container.kill_deadline:
            first = container.kill_deadline == float("inf")
            container.kill_deadline = deadline
            meta["deletionTimestamp"] = now_rfc3339(time.time() + grace)
            meta["deletionGracePeriodSeconds"] = grace
            updated = self.store.put(key, pod, "MODIFIED")
            if first:
                _signal_group(container.process.pid, signal.SIGTERM)
                _signal_group(container.process.pid, signal.SIGCONT)
            timer = threading.Timer(grace, _signal_group, (container.process.pid, signal.SIGKILL))
            timer.daemon = True
            timer.start()
            return updated
        return _copy(pod)

    def _remove(self, key: ObjectKey) -> dict[str, Any] | None:
        """Remove an object and, in cascade, its dependents. Called with the lock held."""
        removed = self.store.remove(key)
        if removed is None:
            return None
        uid = removed["metadata"]["uid"]
        self._arrivals.pop(uid, None)
        for resource in ("pods", "services", "secrets", "configmaps", "networkpolicies", "workflows"):
            for dependent_key, obj in self.store.items(resource, key[1]):
                if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or []):
                    if resource == "pods":
                        self._delete_pod(dependent_key, obj, None)
                    else:
                        self._remove(dependent_key)
        return removed

    def _log_path(self, namespace: str, name: str, uid: str) -> Path:
        return self.workdir / "logs" / f"{namespace}_{name}_{uid}.log"


def _check_labels(resource: str, name: str, meta: Mapping[str, Any]) -> None:
    """Refuse (422 Invalid) an object whose labels the API server would refuse (:func:`label_problems`):
    e.g. a label value over 63 characters."""
    problems = label_problems(meta.get("labels"))
    if problems:
        raise ApiError(422, "Invalid", f'{resource} "{name}" is invalid: ' + "; ".join(problems))


def _refuse_problems(resource: str, name: str, problems: list[str]) -> None:
    """Refuse (422 Invalid) an object with ``problems``, as the API server does."""
    if problems:
        raise ApiError(422, "Invalid", f'{resource} "{name}" is invalid: ' + "; ".join(problems))


def _scope(resource: str, namespace: str) -> str:
    """The namespace an object of ``resource`` is stored under: '' for a cluster-scoped resource."""
    return "" if resource in CLUSTER_SCOPED else namespace


def _merged(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            target[key] = _merged(target[key], value)
        else:
            target[key] = value
    return target


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(obj)


def _argv(container: dict[str, Any]) -> list[str]:
    argv = [*(container.get("command") or []), *(container.get("args") or [])]
    if not argv:
        raise ApiError(400, "RunContainerError", "the stand-in needs an explicit command")
    return [str(a) for a in argv]


def _field(pod: dict[str, Any], path: str) -> str:
    meta = pod["metadata"]
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
        return str((meta.get(m[1]) or {}).get(m[2], ""))
    values = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "status.podIP": POD_IP,
        "status.hostIP": POD_IP,
        "spec.nodeName": pod["spec"].get("nodeName", NODE),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
    }
    if path not in values:
        raise ApiError(400, "CreateContainerConfigError", f"unsupported fieldRef {path}")
    return values[path]


def _set_condition(pod: dict[str, Any], kind: str, status: str, reason: str, message: str) -> None:
    conditions = pod.setdefault("status", {}).setdefault("conditions", [])
    conditions[:] = [c for c in conditions if c.get("type") != kind]
    condition = {"type": kind, "status": status, "lastTransitionTime": now_rfc3339()}
    if reason:
        condition["reason"] = reason
    if message:
        condition["message"] = message
    conditions.append(condition)


def _container_status(
    container: dict[str, Any], state: dict[str, Any], ready: bool = False, started: bool = False
) -> dict[str, Any]:
    return {
        "name": container["name"],
        "image": container["image"],
        "imageID": f"stand-in://{container['image']}",
        "ready": ready,
        "started": started,
        "restartCount": 0,
        "state": state,
    }


def _base_env() -> dict[str, str]:
    """Every container's environment before its own variables: the test process's, minus private ones."""
    return {k: v for k, v in os.environ.items() if not _PRIVATE_ENV.match(k)}


def _resolve_program(program: str) -> str:
    """A bare program name found beside this interpreter (the venv's ``edl-argo``), else as given."""
    if os.sep in program:
        return program
    beside = Path(sys.executable).parent / program
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else program


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
