"""The one interface through which the master starts, watches and removes the pods of a job.

A *pod* is one worker or parameter-server (PS) process of a training job, identified by its
``(role, pod_id)`` pair (its :attr:`~PodSpec.name` is ``"worker-3"``, ``"ps-0"``, ...). The master
describes a pod with a :class:`PodSpec` and hands it to a :class:`PodBackend`, which runs it somewhere
(child processes on this machine, or Kubernetes pods) and reports what happens to it as
:class:`PodEvent` objects. The master never learns how a backend runs pods; it sees the same events,
the same phases and the same reasons from every backend, so its relaunch policy is written once.

Lifecycle of one pod, as reported by :meth:`PodBackend.events`::

    start(spec) ──> [PENDING ...] ──> [RUNNING] ──> exactly one of SUCCEEDED | FAILED | DELETED

Brackets mark events that may be missing (a local process is never PENDING; a pod that cannot be
scheduled or created goes straight to a terminal event).

**Master restarts.** Pods outlive a master that dies without :meth:`PodBackend.close` (killed, node
lost): a new master of the same job takes them over with :meth:`PodBackend.adopt` instead of starting
afresh, and reaches them, and they it, at the same addresses (:meth:`PodBackend.address`,
:meth:`PodBackend.expose_master`).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Final, TypeVar

from edl_argo.errors import ConfigError
from edl_argo.native_logs import is_native_notice
from edl_argo.rpc.auth import JobSecret
from edl_argo.rpc.tls import TlsFiles


class PodRole(str, enum.Enum):
    """What a pod does in the job."""

    WORKER = "worker"
    PS = "ps"


class PodPhase(str, enum.Enum):
    """Where a pod is in its lifecycle (the Kubernetes pod phases, plus DELETED)."""

    PENDING = "Pending"
    """Accepted but not running yet (being scheduled, pulling its image, ...)."""
    RUNNING = "Running"
    """Its main process runs."""
    SUCCEEDED = "Succeeded"
    """Its main process exited with status 0. Terminal."""
    FAILED = "Failed"
    """Its main process exited otherwise, was killed, or could not be started. Terminal."""
    DELETED = "Deleted"
    """Removed through :meth:`PodBackend.delete` or by someone else through the cluster's API. Terminal."""

    @property
    def is_terminal(self) -> bool:
        """Whether nothing more will happen to the pod after this phase."""
        return self in (PodPhase.SUCCEEDED, PodPhase.FAILED, PodPhase.DELETED)


class PodReason:
    """The values of :attr:`PodEvent.reason`: why a pod reached its phase (Kubernetes' words)."""

    STARTED: Final = "Started"
    """RUNNING: the main process started."""
    UNSCHEDULABLE: Final = "Unschedulable"
    """PENDING (or DELETED after the master gives up on it): no node can take the pod now."""
    COMPLETED: Final = "Completed"
    """SUCCEEDED: exit status 0."""
    ERROR: Final = "Error"
    """FAILED: nonzero exit status, a fatal signal other than SIGKILL, or the pod could not be started.
    The event's message says which, with the last lines the pod wrote to stderr."""
    KILLED: Final = "Killed"
    """FAILED: killed by SIGKILL (exit status 137), by a person, a script or the kernel."""
    OOM_KILLED: Final = "OOMKilled"
    """FAILED: killed for exceeding its memory limit (only backends that can tell report it)."""
    PREEMPTED: Final = "Preempted"
    """FAILED or DELETED: evicted by the cluster to make room for other work."""
    DELETED: Final = "Deleted"
    """DELETED: removed by the master (the default reason of :meth:`PodBackend.delete`) or via the API."""


@dataclass(frozen=True)
class PodSpec:
    """Everything a backend needs to run one pod.

    ``command`` is exactly what the pod's container runs, e.g.
    ``("edl-argo", "worker", "--worker-id", "3", ...)``. ``env`` holds non-secret environment variables
    only: secrets are the backend's business (the local backend passes its own environment through;
    the Kubernetes backend mounts them with ``secretKeyRef``). ``port`` is the port a PS listens on and
    is required for a PS; ``tensor_port`` its tensor port's, when fixed (Kubernetes: a container port the
    job's NetworkPolicy opens). ``opportunistic`` marks a worker the job added beyond the workers it asked for
    (growth toward ``--max-workers``): a cluster backend may give it a lower priority, so that other jobs
    take its room back first. The spec is immutable: ``env`` is copied into a read-only mapping.
    """

    role: PodRole
    pod_id: int
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    port: int | None = None
    opportunistic: bool = False
    tensor_port: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", PodRole(self.role))
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        if self.pod_id < 0:
            raise ValueError(f"{self.name}: pod_id must be >= 0")
        if not self.command or not all(isinstance(arg, str) for arg in self.command):
            raise ValueError(f"{self.name}: command must be a non-empty sequence of strings")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError(f"{self.name}: env names and values must be strings")
        for port in (self.port, self.tensor_port):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{self.name}: port {port} is not in 1..65535")
        if self.role is PodRole.PS and self.port is None:
            raise ValueError(f"{self.name}: a PS needs a port")

    @property
    def name(self) -> str:
        """``"<role>-<pod_id>"``, e.g. ``"worker-3"``: unique within a job."""
        return pod_name(self.role, self.pod_id)


@dataclass(frozen=True)
class PodEvent:
    """A change of a pod's phase, as reported by :meth:`PodBackend.events`.

    ``exit_code`` is the main process's exit status when it exited, else None; a process killed by
    signal N reports ``128 + N`` (137 for SIGKILL, 143 for SIGTERM), as container runtimes do.
    ``reason`` is one of the :class:`PodReason` values (for DELETED, the reason given to
    :meth:`PodBackend.delete`). ``message`` is for people: why the pod failed, with the last lines it
    wrote to stderr when the backend has them. ``timestamp`` is wall-clock time (``time.time()``).
    """

    role: PodRole
    pod_id: int
    phase: PodPhase
    exit_code: int | None
    reason: str
    message: str
    timestamp: float

    @property
    def name(self) -> str:
        """The pod's name, ``"<role>-<pod_id>"``."""
        return pod_name(self.role, self.pod_id)

    @property
    def summary(self) -> str:
        """``message`` in one line, for logs and reports: what happened (``"exited with status 1"``) and,
        when the message quotes the pod's output, the error's own last line (:func:`failure_line`)."""
        lines = self.message.splitlines()
        if len(lines) <= 1:
            return self.message.strip()
        head, tail = lines[0].split(_TAIL_HEADER, 1)[0], lines[1:]
        if _TAIL_HEADER not in lines[0]:  # too long, cut from the front: only the output is left
            head, tail = "", lines
        last = failure_line(tail)
        return f"{head}: {last}" if head and last else head or last


#: What separates a terminal event's ``message`` from the pod's last output lines it quotes
#: (``"exited with status 1; last lines of stderr:\n..."``).
_TAIL_HEADER = "; last lines of "


def failure_line(lines: Sequence[str]) -> str:
    """The last non-blank line of a failed process's output that is not a native notice ("" if none):
    the error's own last line (``ValueError: ...``, a ``SystemExit`` message), even when TensorFlow's
    notices came after it."""
    for line in reversed(lines):
        if line.strip() and not is_native_notice(line):
            return line.strip()
    return ""


@dataclass(frozen=True)
class PodStatus:
    """One pod of the job that exists now, as listed by :meth:`PodBackend.list_pods`."""

    role: PodRole
    pod_id: int
    phase: PodPhase

    @property
    def name(self) -> str:
        """The pod's name, ``"<role>-<pod_id>"``."""
        return pod_name(self.role, self.pod_id)


def pod_name(role: PodRole, pod_id: int) -> str:
    """The name of pod ``pod_id`` of ``role``: ``"worker-3"``, ``"ps-0"``."""
    return f"{role.value}-{pod_id}"


def admit_start(
    spec: PodSpec,
    *,
    closed: bool,
    live: Container[tuple[PodRole, int]],
    ports: dict[tuple[PodRole, int], int],
) -> None:
    """The checks every backend's :meth:`PodBackend.start` makes (under its lock) before creating a pod.

    ``live`` holds the ``(role, pod_id)`` of pods whose terminal event was not returned yet; ``ports``
    remembers the port of each pod that had one, and records ``spec``'s.
    """
    key = (spec.role, spec.pod_id)
    if closed:
        raise BackendClosedError(f"cannot start {spec.name}: the backend is closed")
    if key in live:
        raise PodExistsError(f"cannot start {spec.name}: its previous incarnation is not over")
    if spec.port is not None and ports.setdefault(key, spec.port) != spec.port:
        raise ValueError(
            f"cannot start {spec.name} on port {spec.port}: it listened on"
            f" {ports[key]} before, and its address must not change"
        )


_Backend = TypeVar("_Backend", bound="PodBackend")


class PodExistsError(RuntimeError):
    """:meth:`PodBackend.start` was asked to start a pod whose previous incarnation is not over yet."""


class BackendClosedError(RuntimeError):
    """:meth:`PodBackend.start` was called after :meth:`PodBackend.close`."""


class PodBackend(abc.ABC):
    """Runs the pods of one job and reports their phase changes.

    **Events are pulled.** A backend records what happens to its pods in a queue; the master takes
    them with :meth:`events`, typically in its main loop (``for e in backend.events(timeout=1.0)``).
    There are no callbacks, so no master code runs on a backend thread.

    Guarantees, for every backend:

    * Events of one pod are delivered in the order they happened: zero or more PENDING, at most one
      RUNNING, then exactly one terminal event (SUCCEEDED, FAILED or DELETED). Events of different
      pods may interleave in any order.
    * Every pod passed to :meth:`start` yields exactly one terminal event, whatever happens to it:
      exit, crash, eviction, :meth:`delete`, :meth:`close`, or failure to create it (``start`` does
      not raise for problems of the pod itself; they arrive as a FAILED event).
    * A pod's ``(role, pod_id)`` can be started again (relaunched) once :meth:`events` has returned
      its terminal event, and not before; so every event after that one belongs to the new
      incarnation and the master never mistakes an old pod's death for the new one's.
    * A pod is its whole process tree: when its main process exits, the backend kills the pod's other
      processes before reporting the terminal event (they may take a moment more to vanish).

    All methods are thread-safe. :meth:`events` is meant for a single consumer; with several, each
    event goes to exactly one of them.

    **Credentials.** The master hands the backend the job's secret (:meth:`use_job_secret`) before it
    starts a pod; the backend gives each pod its credentials (:meth:`JobSecret.pod_env
    <edl_argo.rpc.auth.JobSecret.pod_env>`) without putting them in the :class:`PodSpec`. A backend that
    keeps the secret itself across master restarts (:attr:`keeps_job_secret`) returns it from
    :meth:`stored_job_secret`.
    """

    #: The job's secret, once :meth:`use_job_secret` gave it.
    job_secret: JobSecret | None = None
    #: Whether :meth:`stored_job_secret` returns the secret a restarted master must reuse.
    keeps_job_secret: bool = False

    def stored_job_secret(self) -> JobSecret | None:
        """The secret an earlier master of this job left with the backend, or None (the default)."""
        return None

    def use_job_secret(self, secret: JobSecret) -> None:
        """Give the pods started from now on their credentials derived from ``secret``."""
        self.job_secret = secret

    def tls_secret(self, name: str) -> TlsFiles:
        """The TLS files of the Secret ``name`` (``--tls-secret``, :mod:`edl_argo.rpc.tls`); only a backend
        with Secrets has them (ConfigError otherwise)."""
        raise ConfigError(f"--tls-secret {name}: this backend has no Secrets (use --tls-dir DIR)")

    @abc.abstractmethod
    def start(self, spec: PodSpec) -> None:
        """Submit a pod and return without waiting for it to run.

        What happens next is reported by :meth:`events`.

        Raises:
            PodExistsError: a pod with the same ``(role, pod_id)`` was started and its terminal
                event has not been returned by :meth:`events` yet.
            BackendClosedError: :meth:`close` was called.
            ValueError: a PS is relaunched on a different port than before (its address must not
                change).
        """

    @abc.abstractmethod
    def delete(
        self, role: PodRole, pod_id: int, *, reason: str = PodReason.DELETED, grace_seconds: float = 5.0
    ) -> None:
        """Ask a pod to stop, and return without waiting for it to stop.

        The pod gets SIGTERM, and SIGKILL if it still runs ``grace_seconds`` later (0: at once).
        Unless it had already exited, its terminal event is DELETED with ``reason``. Idempotent:
        deleting a pod that is gone, has exited or was never started does nothing (a repeated call
        may only shorten the grace period).
        """

    @abc.abstractmethod
    def events(self, timeout: float | None = None) -> list[PodEvent]:
        """Take the events that happened since the last call, oldest first.

        Returns at once if there are any; otherwise waits up to ``timeout`` seconds (``None``:
        until there are, ``0``: not at all) and returns what arrived, possibly ``[]``. After
        :meth:`close`, returns the events still queued (the terminal events of the pods it deleted)
        and then ``[]`` without waiting.
        """

    @abc.abstractmethod
    def address(self, role: PodRole, pod_id: int) -> str:
        """``"host:port"`` at which other pods reach pod ``pod_id`` of ``role`` (a PS).

        The address is the same for every incarnation of the pod, so workers keep reaching a PS
        after it is relaunched.

        Raises:
            KeyError: the backend cannot know the address (the local backend: the pod was never
                started).
            ValueError: pods of this role do not listen on a port.
        """

    @abc.abstractmethod
    def list_pods(self) -> list[PodStatus]:
        """The job's pods that exist now, sorted by role and id, so that a restarted master can adopt them.

        A pod is listed from :meth:`start` until :meth:`events` has returned its terminal event, so its
        listed phase may already be terminal; a backend over a cluster also lists the pods of the job
        that an earlier master started. Events of listed pods keep arriving through :meth:`events`.
        """

    @abc.abstractmethod
    def adopt(self) -> list[PodStatus]:
        """Take over the pods of this job that an earlier backend left running; returns them, sorted.

        An earlier backend is the one of a master of the same job that ended without :meth:`close`
        (killed, or lost with its node). Each of its pods that still runs (or is still pending) is
        tracked from now on exactly as if this backend had started it: :meth:`list_pods` lists it,
        :meth:`delete` and :meth:`close` remove it, :meth:`address` of an adopted PS is the address it
        listens on, and its events arrive through :meth:`events`: at least its terminal event (a
        backend may first report the phase it finds it in, e.g. RUNNING). Pods of the job that have
        already ended are removed (with whatever the backend kept of them) and are neither returned
        nor reported. Pods this backend started itself are not returned, nor pods an earlier call
        returned: calling it again returns ``[]`` unless more pods appeared.

        Call it before the first :meth:`start` of a pod it might return. The master calls it once at
        start: to continue the job with the pods it returns, or else to delete them and start afresh.
        Raises :class:`BackendClosedError` after :meth:`close`.
        """

    def expose_master(self, address: str) -> str:
        """The address pods should use to reach the master serving at ``address`` (``"host:port"``).

        The answer is the same for every master of the job that serves on the same port, so the
        ``--master-addr`` of running pods stays valid when a restarted master (possibly on another
        host) rebinds the port. By default ``address`` itself (the same host: the local backend);
        a cluster backend may put a stable virtual address (a Service) in front of the master.
        """
        return address

    @abc.abstractmethod
    def close(self, *, grace_seconds: float = 5.0) -> None:
        """Delete every pod this backend started and wait until they are gone.

        Idempotent. Afterwards :meth:`start` raises :class:`BackendClosedError`.
        """

    def __enter__(self: _Backend) -> _Backend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
