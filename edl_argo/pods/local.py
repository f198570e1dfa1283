"""Pods as child processes of the master: the backend for ``make demo``, laptops and tests.

Each pod is its command run by :class:`subprocess.Popen` in a new session, so the pod is a process
group (its main process and everything that process starts) that one signal reaches. Per pod, two
threads copy the child's stdout and stderr line by line to a log sink, each line prefixed with the
pod's name (``[worker-3] ...``), and a waiter thread reports the exit. When the main process exits,
the waiter SIGKILLs what is left of the group, as a container runtime does when a container's first
process exits, and reports the exit once the log threads have copied everything (the pipes close when
the last process of the group has exited, or after a few seconds). Processes that leave the group
(``setsid``) are neither killed nor waited for. The lines of a pod's stdout and of its stderr each
keep their order; how the two streams interleave is not defined.

If the master dies without :meth:`LocalProcessBackend.close`, its pods keep running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

from edl_argo.log import get_logger
from edl_argo.pods.base import (
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
from edl_argo.pods.event_queue import EventQueue

log = get_logger(__name__)

STDERR_TAIL_LINES = 10
"""How many of its last stderr lines a FAILED event's message quotes."""

_MESSAGE_MAX_CHARS = 2000
_MAX_LINE_BYTES = 64 * 1024  # a longer line is logged in pieces of this size
_PIPE_DRAIN_SECONDS = 2.0  # how long an exited pod's log threads may take to copy what is left

_PodKey = tuple[PodRole, int]


@dataclass(eq=False)
class _LocalPod:
    """The backend's record of one incarnation of a pod. Mutable fields are guarded by the backend lock."""

    spec: PodSpec
    process: subprocess.Popen[bytes] | None = None
    phase: PodPhase = PodPhase.PENDING
    returncode: int | None = None
    delete_reason: str | None = None
    kill_deadline: float = float("inf")
    kill_timer: threading.Timer | None = None
    log_threads: list[threading.Thread] = field(default_factory=list)
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))

    @property
    def alive(self) -> bool:
        """Whether the main process was started and has not been seen to exit."""
        return self.process is not None and self.returncode is None


class LocalProcessBackend(PodBackend):
    """Runs each pod's command as a child process of this one (see the module docstring).

    Args:
        job_name: passed to every pod as ``EDL_JOB_NAME``.
        log_sink: where the pods' output goes, one prefixed line per ``write`` call (default: the
            ``sys.stderr`` of the moment the backend is created).
        host: the host part of PS addresses.

    A pod's environment is this process's environment, then ``PYTHONUNBUFFERED=1`` unless already set
    (so Python pods' logs arrive as they are written), then ``spec.env``, then ``EDL_POD_NAME``,
    ``EDL_POD_ROLE``, ``EDL_POD_ID`` and ``EDL_JOB_NAME``. A bare program name in ``spec.command[0]``
    (like ``edl-argo``) is looked up first in the directory of ``sys.executable`` (this virtualenv's
    ``bin``), so pods run the same installation as the master, then on ``PATH``.
    """

    def __init__(self, job_name: str, log_sink: TextIO | None = None, host: str = "127.0.0.1") -> None:
        self.job_name = job_name
        self.host = host
        self._sink = log_sink if log_sink is not None else sys.stderr
        self._sink_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pods: dict[_PodKey, _LocalPod] = {}
        self._ports: dict[_PodKey, int] = {}
        self._waiters: set[threading.Thread] = set()
        self._queue = EventQueue()
        self._closed = False

    # -- PodBackend ------------------------------------------------------------------------------

    def start(self, spec: PodSpec) -> None:
        key = (spec.role, spec.pod_id)
        with self._lock:
            admit_start(spec, closed=self._closed, live=self._pods, ports=self._ports)
            pod = self._pods[key] = _LocalPod(spec)
            try:
                pod.process = self._popen(spec)
            except (OSError, ValueError) as error:
                log.warning("pod_start_failed", job=self.job_name, pod=spec.name, error=str(error))
                self._finish(pod, PodPhase.FAILED, PodReason.ERROR, None, f"cannot start: {error}")
                return
            pod.phase = PodPhase.RUNNING
            self._queue.put(_event(spec, PodPhase.RUNNING, PodReason.STARTED))
            log.info("pod_started", job=self.job_name, pod=spec.name, pid=pod.process.pid)
            for stream, tail in ((pod.process.stdout, None), (pod.process.stderr, pod.stderr_tail)):
                assert stream is not None
                pod.log_threads.append(self._spawn(self._copy_lines, f"{spec.name}-log", pod, stream, tail))
            self._waiters.add(self._spawn(self._wait, f"{spec.name}-wait", pod))

    def delete(
        self, role: PodRole, pod_id: int, *, reason: str = PodReason.DELETED, grace_seconds: float = 5.0
    ) -> None:
        with self._lock:
            pod = self._pods.get((role, pod_id))
            if pod is None or not pod.alive:
                return
            assert pod.process is not None
            if pod.delete_reason is None:
                pod.delete_reason = reason
                log.info(
                    "pod_delete", job=self.job_name, pod=pod.spec.name, reason=reason, grace_s=grace_seconds
                )
                _signal_group(pod.process.pid, signal.SIGTERM)
                _signal_group(pod.process.pid, signal.SIGCONT)  # a paused pod must see its SIGTERM
            self._schedule_kill(pod, grace_seconds)

    def events(self, timeout: float | None = None) -> list[PodEvent]:
        events = self._queue.take(timeout)
        with self._lock:
            for event in events:
                if event.phase.is_terminal:
                    self._pods.pop((event.role, event.pod_id), None)
        return events

    def address(self, role: PodRole, pod_id: int) -> str:
        with self._lock:
            port = self._ports.get((role, pod_id))
        if port is None:
            if role is PodRole.PS:
                raise KeyError(f"{pod_name(role, pod_id)} was never started, so it has no address")
            raise ValueError(f"{pod_name(role, pod_id)} does not listen on a port")
        return f"{self.host}:{port}"

    def list_pods(self) -> list[PodStatus]:
        with self._lock:
            return [
                PodStatus(role, pod_id, pod.phase)
                for (role, pod_id), pod in sorted(self._pods.items(), key=lambda item: _sort_key(item[0]))
            ]

    def close(self, *, grace_seconds: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            keys = list(self._pods)
            waiters = list(self._waiters)
        for role, pod_id in keys:
            self.delete(role, pod_id, grace_seconds=grace_seconds)
        for waiter in waiters:
            waiter.join()
        self._queue.close()

    # -- tests and chaos ---------------------------------------------------------------------------

    def pause(self, role: PodRole, pod_id: int) -> None:
        """SIGSTOP every process of a running pod (for tests and chaos experiments, not the master)."""
        self.kill(role, pod_id, signal.SIGSTOP)

    def resume(self, role: PodRole, pod_id: int) -> None:
        """SIGCONT every process of a paused pod (for tests and chaos experiments, not the master)."""
        self.kill(role, pod_id, signal.SIGCONT)

    def kill(self, role: PodRole, pod_id: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process of a running pod, as an outside actor would.

        For tests and chaos experiments, not the master (it uses :meth:`delete`): the pod's terminal
        event is the one of an unexpected death (SIGKILL: FAILED/Killed).

        Raises:
            KeyError: the pod is not running.
        """
        with self._lock:
            pod = self._pods.get((role, pod_id))
            if pod is None or not pod.alive:
                raise KeyError(f"{pod_name(role, pod_id)} is not running")
            assert pod.process is not None
            _signal_group(pod.process.pid, sig)

    # -- internals -----------------------------------------------------------------------------------

    def _popen(self, spec: PodSpec) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(spec.env)
        env.update(
            EDL_POD_NAME=spec.name,
            EDL_POD_ROLE=spec.role.value,
            EDL_POD_ID=str(spec.pod_id),
            EDL_JOB_NAME=self.job_name,
        )
        return subprocess.Popen(
            [_resolve_program(spec.command[0]), *spec.command[1:]],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    @staticmethod
    def _spawn(target: Callable[..., None], name: str, *args: object) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, args=args, daemon=True)
        thread.start()
        return thread

    def _copy_lines(self, pod: _LocalPod, stream: IO[bytes], tail: deque[str] | None) -> None:
        """Copy one output stream of a pod to the sink, a whole prefixed line per write."""
        prefix = f"[{pod.spec.name}] "
        with stream:
            for chunk in iter(lambda: stream.readline(_MAX_LINE_BYTES), b""):
                line = chunk.decode("utf-8", errors="replace").rstrip("\r\n")
                if tail is not None:
                    tail.append(line)
                with self._sink_lock:
                    try:
                        self._sink.write(prefix + line + "\n")
                        self._sink.flush()
                    except (OSError, ValueError):  # a closed sink: keep draining so the pod never blocks
                        pass

    def _wait(self, pod: _LocalPod) -> None:
        """Wait for a pod's main process to exit, clean up its group and report the terminal event."""
        assert pod.process is not None
        returncode = pod.process.wait()
        with self._lock:
            pod.returncode = returncode
        _signal_group(pod.process.pid, signal.SIGKILL)  # whatever the main process left behind
        for thread in pod.log_threads:
            thread.join(_PIPE_DRAIN_SECONDS)
        exit_code = returncode if returncode >= 0 else 128 - returncode
        how = _describe_exit(returncode)
        if pod.delete_reason is not None:
            phase, reason, message = PodPhase.DELETED, pod.delete_reason, f"deleted; {how}"
        elif returncode == 0:
            phase, reason, message = PodPhase.SUCCEEDED, PodReason.COMPLETED, how
        else:
            phase = PodPhase.FAILED
            reason = PodReason.KILLED if exit_code == 128 + signal.SIGKILL else PodReason.ERROR
            message = _with_tail(how, list(pod.stderr_tail))  # a copy: a log thread may still append
        with self._lock:
            self._finish(pod, phase, reason, exit_code, message)
            self._waiters.discard(threading.current_thread())

    def _finish(
        self, pod: _LocalPod, phase: PodPhase, reason: str, exit_code: int | None, message: str
    ) -> None:
        """Record and report a pod's terminal event. Called with the lock held."""
        if pod.kill_timer is not None:
            pod.kill_timer.cancel()
        pod.phase = phase
        report = log.warning if phase is PodPhase.FAILED else log.info
        report(
            "pod_exited",
            job=self.job_name,
            pod=pod.spec.name,
            phase=phase.value,
            reason=reason,
            exit_code=exit_code,
        )
        self._queue.put(_event(pod.spec, phase, reason, exit_code, message))

    def _schedule_kill(self, pod: _LocalPod, grace_seconds: float) -> None:
        """SIGKILL the pod's group ``grace_seconds`` from now, unless that is already due sooner."""
        assert pod.process is not None
        deadline = time.monotonic() + max(grace_seconds, 0.0)
        if deadline >= pod.kill_deadline:
            return
        pod.kill_deadline = deadline
        if pod.kill_timer is not None:
            pod.kill_timer.cancel()
        if grace_seconds <= 0:
            _signal_group(pod.process.pid, signal.SIGKILL)
            return
        pod.kill_timer = threading.Timer(grace_seconds, _signal_group, (pod.process.pid, signal.SIGKILL))
        pod.kill_timer.daemon = True
        pod.kill_timer.start()


def _event(
    spec: PodSpec, phase: PodPhase, reason: str, exit_code: int | None = None, message: str = ""
) -> PodEvent:
    return PodEvent(spec.role, spec.pod_id, phase, exit_code, reason, message, time.time())


def _signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group; a group that no longer exists is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _resolve_program(program: str) -> str:
    """``program`` from this interpreter's ``bin`` directory if it is a bare name found there."""
    if os.sep in program or (os.altsep and os.altsep in program):
        return program
    beside = Path(sys.executable).parent / program
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else program


def _describe_exit(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def _with_tail(message: str, tail: list[str]) -> str:
    """``message``, then the last stderr lines, keeping the end if that is too long."""
    if not tail:
        return message
    text = f"{message}; last lines of stderr:\n" + "\n".join(tail)
    return text if len(text) <= _MESSAGE_MAX_CHARS else "..." + text[-_MESSAGE_MAX_CHARS:]


def _sort_key(key: _PodKey) -> tuple[str, int]:
    return key[0].value, key[1]
