"""Pods as local processes: the backend for ``make demo``, laptops and tests.

**Process groups.** Each pod is its command run under a tiny supervisor (:mod:`edl_argo.pods.supervisor`)
in a new session, so the pod is a process group -- the supervisor, the command, and everything the command
starts -- that one signal reaches. The supervisor forks the command, waits for it, writes its exit status
to a file and exits with it. It ignores SIGTERM, SIGINT and SIGHUP itself (they reach the command directly,
as members of the group); SIGKILL of the group kills it too, which is how a killed pod is told from one
that exited.

**Exec or fork.** A pod's supervisor is started one of two ways, with the same result. *exec*: ``python -I
-S supervisor.py <folder> <program> <args>...`` (only the standard library: it starts in milliseconds),
which forks and execs the command. *fork*: the pod commands of this installation's ``edl-argo`` (``worker``
and ``ps``) are forked from the backend's pod template, a process that has already imported TensorFlow
(:mod:`edl_argo.pods.prefork`): such a pod starts its work within a second instead of after 4.5-6 s of
importing. The template's supervisors are not this process's children: a pipe that only the supervisor
holds open tells their end at once. ``EDL_LOCAL_PREFORK=0`` switches the template off; a pod whose
import-time environment differs from the template's, any other command, and every pod after the template
failed (one log line) use exec.

**Files, not pipes.** Each incarnation of a pod has a folder ``<pods dir>/<pod>.<token>/``, the pods dir
being ``<run dir>/pods/<job>`` (run dir: :func:`edl_argo.run_dir.run_dir`). It holds:

* ``pod.json``: role, id, command, environment, port and start time, written before the pod starts;
* ``supervisor``: the supervisor's pid (the group's id) and its start time in clock ticks since boot (so
  that a later process that got the same pid is not mistaken for it), written by the supervisor first;
* ``stdout`` and ``stderr``: everything the pod writes;
* ``exit``: the command's exit status (``-N``: killed by signal N), written by the supervisor last.

A tail thread per pod copies the new lines of ``stdout`` and ``stderr`` to the log sink, each line
prefixed with the pod's name (``[worker-3] ...``), and keeps the last stderr lines for a FAILED
event's message. The lines of each stream keep their order; how the two interleave is not defined. A
waiter thread per pod waits for the supervisor to exit, SIGKILLs what is left of the group (as a
container runtime does when a container's first process exits), copies the rest of the output and
reports the terminal event; the folder is then removed. Processes that leave the group (``setsid``) are
neither killed nor waited for.

**Master restarts.** Nothing of a pod depends on the master process, so when the master dies without
:meth:`LocalProcessBackend.close` (killed, crashed) its pods keep running. A new backend of the same
job takes them over with :meth:`LocalProcessBackend.adopt`: it reads the folders, adopts each pod whose
supervisor is still the same live process, tails its output from where the files end at adoption
(what the pod wrote while no master watched stays in its files until it ends), and watches it by
polling its supervisor (it is not this process's child, so it cannot be waited for) every
:data:`ADOPTED_POLL_SECONDS`. The folders of pods that ended meanwhile are removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from edl_argo.addresses import join_host_port
from edl_argo.log import get_logger
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
from edl_argo.pods.event_queue import EventQueue
from edl_argo.pods.prefork import (
    ForkRequest,
    PodTemplate,
    pod_base_environment,
    prefork_enabled,
    sigint_ignored,
    wait_exit_pipe,
)
from edl_argo.pods.supervisor import EXIT_FILE, SUPERVISOR_FILE
from edl_argo.run_dir import run_dir

log = get_logger(__name__)

STDERR_TAIL_LINES = 10
"""How many of its last stderr lines a FAILED event's message quotes."""

ADOPTED_POLL_SECONDS = 0.2
"""How often the waiter of an adopted pod checks whether its supervisor still runs."""

_MESSAGE_MAX_CHARS = 2000
_MAX_LINE_BYTES = 64 * 1024  # a longer line is logged in pieces of this size
_READ_BYTES = 1024 * 1024  # what a tail reads at most at once
_TAIL_POLL_SECONDS = 0.05  # how often a pod's output files are checked for new lines
_STDERR_TAIL_BYTES = 16 * 1024  # how much of an adopted pod's stderr is read back for its tail

#: Names of the files in a pod's folder (see the module docstring).
RECORD_FILE, STDOUT_FILE, STDERR_FILE = "pod.json", "stdout", "stderr"

#: The supervisor program of a pod started with exec: ``python -I -S SUPERVISOR <pod folder> <program>
#: <args>...`` (:mod:`edl_argo.pods.supervisor`).
SUPERVISOR = str(Path(__file__).with_name("supervisor.py"))

_PodKey = tuple[PodRole, int]


@dataclass(eq=False)
class _LocalPod:
    """The backend's record of one incarnation of a pod. Mutable fields are guarded by the backend lock."""

    spec: PodSpec
    folder: Path
    process: subprocess.Popen[bytes] | None = None
    """The supervisor, if this backend started it with exec (None for an adopted or forked pod)."""
    exit_pipe: int | None = None
    """A forked pod's supervisor's pipe, at end-of-file once it exited (:mod:`edl_argo.pods.prefork`)."""
    pgid: int | None = None
    """The supervisor's pid, which is the pod's process group id; None until it started."""
    start_ticks: str = ""
    """An adopted pod's supervisor's start time (``/proc/<pid>/stat``), to tell it from a reused pid."""
    phase: PodPhase = PodPhase.PENDING
    returncode: int | None = None
    delete_reason: str | None = None
    kill_deadline: float = float("inf")
    kill_timer: threading.Timer | None = None
    output_done: threading.Event = field(default_factory=threading.Event)
    tail_thread: threading.Thread | None = None
    waiter: threading.Thread | None = None
    """The thread that waits for the pod's end and reports it (None until it is watched)."""
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))

    @property
    def alive(self) -> bool:
        """Whether the main process was started and has not been seen to exit."""
        return self.pgid is not None and self.returncode is None


class LocalProcessBackend(PodBackend):
    """Runs each pod's command as a process group of this machine (see the module docstring).

    Args:
        job_name: passed to every pod as ``EDL_JOB_NAME``; names the pods dir.
        log_sink: where the pods' output goes, one prefixed line per ``write`` call (default: the
            ``sys.stderr`` of the moment the backend is created).
        host: the host part of PS addresses.
        pods_dir: the folder of the job's pod folders (default ``<run dir>/pods/<job_name>``); a
            backend adopts the pods found there.
        pod_template: a template to fork pods from that outlives the backend (its owner closes it:
            :func:`~edl_argo.pods.prefork.process_template`); default: the backend's own, started with the
            first ``edl-argo`` pod unless :data:`~edl_argo.pods.prefork.PREFORK_ENV` switches it off, and
            closed with the backend.

    A pod's environment is this process's environment, then ``PYTHONUNBUFFERED=1`` unless already set
    (so Python pods' logs arrive as they are written), then ``spec.env``, then ``EDL_POD_NAME``,
    ``EDL_POD_ROLE``, ``EDL_POD_ID`` and ``EDL_JOB_NAME``, without the credentials of this process
    (:data:`~edl_argo.rpc.auth.CREDENTIAL_ENV`) and with the pod's own once the master gave the job's
    secret (:meth:`use_job_secret`); they are written nowhere (``pod.json`` holds ``spec.env`` only). A
    bare program name in ``spec.command[0]``
    (like ``edl-argo``) is looked up first in the directory of ``sys.executable`` (this virtualenv's
    ``bin``), so pods run the same installation as the master, then on the pod's ``PATH``.
    """

    def __init__(
        self,
        job_name: str,
        log_sink: TextIO | None = None,
        host: str = "127.0.0.1",
        pods_dir: Path | None = None,
        pod_template: PodTemplate | None = None,
    ) -> None:
        self.job_name = job_name
        self.host = host
        self.pods_dir = pods_dir if pods_dir is not None else run_dir() / "pods" / job_name
        self._sink = log_sink if log_sink is not None else sys.stderr
        self._sink_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pods: dict[_PodKey, _LocalPod] = {}
        self._ports: dict[_PodKey, int] = {}
        self._waiters: set[threading.Thread] = set()
        self._queue = EventQueue()
        self._closed = False
        self._owns_template = pod_template is None
        self._template = pod_template or PodTemplate(
            job_name, pod_base_environment, enabled=prefork_enabled(os.environ)
        )

    # -- PodBackend ------------------------------------------------------------------------------

    def start(self, spec: PodSpec) -> None:
        key = (spec.role, spec.pod_id)
        with contextlib.suppress(FileNotFoundError):  # the template's first start: not under the lock
            if self._template.serves(_resolve_program(spec.command[0], os.environ.get("PATH"))):
                self._template.warm_up()
        with self._lock:
            admit_start(spec, closed=self._closed, live=self._pods, ports=self._ports)
            folder = self.pods_dir / f"{spec.name}.{uuid.uuid4().hex[:12]}"
            pod = self._pods[key] = _LocalPod(spec, folder)
            try:
                self._launch(pod)
            except (OSError, ValueError) as error:
                log.warning("pod_start_failed", job=self.job_name, pod=spec.name, error=str(error))
                self._finish(pod, PodPhase.FAILED, PodReason.ERROR, None, f"cannot start: {error}")
                return
            self._watch(pod, self._wait_of(pod), (0, 0))  # first: what follows may be interrupted
            pod.phase = PodPhase.RUNNING
            self._queue.put(_event(spec, PodPhase.RUNNING, PodReason.STARTED))
            forked = pod.exit_pipe is not None
            log.info("pod_started", job=self.job_name, pod=spec.name, pid=pod.pgid, forked=forked)

    def adopt(self) -> list[PodStatus]:
        with self._lock:
            if self._closed:
                raise BackendClosedError("cannot adopt pods: the backend is closed")
            known = {pod.folder for pod in self._pods.values()}
        adopted: list[PodStatus] = []
        for folder in self._pod_folders():
            if folder in known:
                continue
            spec, supervisor = _read_record(folder), _read_supervisor(folder)
            running = (
                spec is not None
                and supervisor is not None
                and _read_exit(folder) is None
                and _start_ticks(supervisor[0]) == supervisor[1]
            )
            with self._lock:
                if running and spec is not None and (spec.role, spec.pod_id) not in self._pods:
                    assert supervisor is not None
                    self._adopt(spec, folder, *supervisor)
                    adopted.append(PodStatus(spec.role, spec.pod_id, PodPhase.RUNNING))
                    continue
            if running and supervisor is not None:  # a second incarnation of one pod: cannot be ours
                _signal_group(supervisor[0], signal.SIGKILL)
            log.info("pod_leftover_removed", job=self.job_name, folder=folder.name)
            shutil.rmtree(folder, ignore_errors=True)
        return sorted(adopted, key=lambda status: _sort_key((status.role, status.pod_id)))

    def delete(
        self, role: PodRole, pod_id: int, *, reason: str = PodReason.DELETED, grace_seconds: float = 5.0
    ) -> None:
        with self._lock:
            pod = self._pods.get((role, pod_id))
            if pod is None or not pod.alive:
                return
            assert pod.pgid is not None
            if pod.delete_reason is None:
                pod.delete_reason = reason
                log.info(
                    "pod_delete", job=self.job_name, pod=pod.spec.name, reason=reason, grace_s=grace_seconds
                )
                _signal_group(pod.pgid, signal.SIGTERM)
                _signal_group(pod.pgid, signal.SIGCONT)  # a paused pod must see its SIGTERM
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
        return join_host_port(self.host, port)

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
            for pod in self._pods.values():
                if pod.alive and pod.waiter is None:  # started as an interrupt (Ctrl-C, SIGTERM) came
                    self._watch(pod, self._wait_of(pod), (0, 0))
            waiters = list(self._waiters)
        if self._owns_template:
            self._template.close()
        for role, pod_id in keys:
            self.delete(role, pod_id, grace_seconds=grace_seconds)
        for waiter in waiters:
            waiter.join()
        self._queue.close()
        with contextlib.suppress(OSError):  # other backends of the job may still have pods there
            self.pods_dir.rmdir()

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
            assert pod.pgid is not None
            _signal_group(pod.pgid, sig)

    # -- internals -----------------------------------------------------------------------------------

    def _launch(self, pod: _LocalPod) -> None:
        """Create the pod's folder and start its supervisor, forked by the template if it takes the pod,
        else with exec; OSError if the command cannot run. Sets ``pgid`` and ``process`` or ``exit_pipe``."""
        spec, folder = pod.spec, pod.folder
        env = pod_base_environment()
        env.update(spec.env)
        env.update(
            EDL_POD_NAME=spec.name,
            EDL_POD_ROLE=spec.role.value,
            EDL_POD_ID=str(spec.pod_id),
            EDL_JOB_NAME=self.job_name,
        )
        if self.job_secret is not None:
            env.update(self.job_secret.pod_env(spec.role.value, spec.pod_id))
        program = _resolve_program(spec.command[0], env.get("PATH"))
        folder.mkdir(parents=True)
        record = {
            "job": self.job_name,
            "role": spec.role.value,
            "pod_id": spec.pod_id,
            "command": list(spec.command),
            "env": dict(spec.env),
            "port": spec.port,
            "started": time.time(),
        }
        _write_atomically(folder / RECORD_FILE, json.dumps(record))
        if self._template.serves(program):
            argv = (program, *spec.command[1:])
            forked = self._template.fork(ForkRequest(argv, env, os.getcwd(), str(folder), sigint_ignored()))
            if forked is not None:
                pod.pgid, pod.exit_pipe = forked.pid, forked.exit_pipe
                return
        try:
            with open(folder / STDOUT_FILE, "ab") as stdout, open(folder / STDERR_FILE, "ab") as stderr:
                pod.process = subprocess.Popen(
                    [sys.executable, "-I", "-S", SUPERVISOR, str(folder), program, *spec.command[1:]],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    start_new_session=True,
                )
        except OSError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        pod.pgid = pod.process.pid

    def _adopt(self, spec: PodSpec, folder: Path, pgid: int, start_ticks: str) -> None:
        """Track a running pod of an earlier backend (with the lock held)."""
        key = (spec.role, spec.pod_id)
        pod = self._pods[key] = _LocalPod(
            spec, folder, pgid=pgid, start_ticks=start_ticks, phase=PodPhase.RUNNING
        )
        if spec.port is not None:
            self._ports[key] = spec.port
        offsets = (_size(folder / STDOUT_FILE), _size(folder / STDERR_FILE))
        pod.stderr_tail.extend(_last_lines(folder / STDERR_FILE, offsets[1]))
        log.info("pod_adopted", job=self.job_name, pod=spec.name, pid=pgid)
        self._watch(pod, self._wait_adopted, offsets)

    def _pod_folders(self) -> list[Path]:
        try:
            return sorted(entry for entry in self.pods_dir.iterdir() if entry.is_dir())
        except FileNotFoundError:
            return []

    def _watch(self, pod: _LocalPod, wait: Callable[[_LocalPod], int], offsets: tuple[int, int]) -> None:
        """Start the tail and waiter threads of a running pod (with the lock held)."""
        name = pod.spec.name
        pod.tail_thread = _spawn(self._tail, f"{name}-log", pod, offsets)
        pod.waiter = _spawn(self._wait, f"{name}-wait", pod, wait)
        self._waiters.add(pod.waiter)

    def _wait_of(self, pod: _LocalPod) -> Callable[[_LocalPod], int]:
        """How to wait for the end of a pod this backend started: forked, or its supervisor a child."""
        return self._wait_forked if pod.exit_pipe is not None else self._wait_child

    def _tail(self, pod: _LocalPod, offsets: tuple[int, int]) -> None:
        """Copy the pod's new output lines to the sink until its waiter says the output is complete."""
        prefix = f"[{pod.spec.name}] "
        with contextlib.ExitStack() as files:
            tails = [
                _FileTail(files.enter_context(open(pod.folder / STDOUT_FILE, "rb")), offsets[0]),
                _FileTail(files.enter_context(open(pod.folder / STDERR_FILE, "rb")), offsets[1]),
            ]
            while True:
                final = pod.output_done.is_set()
                for tail, keep in zip(tails, (None, pod.stderr_tail), strict=True):
                    for line in tail.lines(final):
                        if keep is not None:
                            keep.append(line)
                        self._emit(prefix + line)
                if final:
                    return
                pod.output_done.wait(_TAIL_POLL_SECONDS)

    def _emit(self, line: str) -> None:
        with self._sink_lock:
            try:
                self._sink.write(line + "\n")
                self._sink.flush()
            except (OSError, ValueError):  # a closed sink: the pod's output stays in its files
                pass

    @staticmethod
    def _wait_child(pod: _LocalPod) -> int:
        """The exit status of a pod this backend started (its supervisor is our child)."""
        assert pod.process is not None
        supervisor_status = pod.process.wait()
        code = _read_exit(pod.folder)
        return supervisor_status if code is None else code  # no file: the supervisor was killed

    @staticmethod
    def _wait_forked(pod: _LocalPod) -> int:
        """The exit status of a pod the template forked (its supervisor is the template's child)."""
        assert pod.exit_pipe is not None
        wait_exit_pipe(pod.exit_pipe)
        code = _read_exit(pod.folder)
        return -signal.SIGKILL if code is None else code  # no file: the supervisor was killed

    @staticmethod
    def _wait_adopted(pod: _LocalPod) -> int:
        """The exit status of an adopted pod, by polling its supervisor (not our child)."""
        assert pod.pgid is not None
        while True:
            code = _read_exit(pod.folder)
            if code is not None:
                return code
            if _start_ticks(pod.pgid) != pod.start_ticks:
                code = _read_exit(pod.folder)  # written just before the supervisor exits
                return -signal.SIGKILL if code is None else code  # killed with its whole group
            time.sleep(ADOPTED_POLL_SECONDS)

    def _wait(self, pod: _LocalPod, wait: Callable[[_LocalPod], int]) -> None:
        """Wait for a pod's main process to end, clean up its group and report the terminal event."""
        assert pod.pgid is not None and pod.tail_thread is not None
        returncode = wait(pod)
        with self._lock:
            pod.returncode = returncode
        _signal_group(pod.pgid, signal.SIGKILL)  # whatever the main process left behind
        pod.output_done.set()
        pod.tail_thread.join()
        exit_code = returncode if returncode >= 0 else 128 - returncode
        how = _describe_exit(returncode)
        if pod.delete_reason is not None:
            phase, reason, message = PodPhase.DELETED, pod.delete_reason, f"deleted; {how}"
        elif returncode == 0:
            phase, reason, message = PodPhase.SUCCEEDED, PodReason.COMPLETED, how
        else:
            phase = PodPhase.FAILED
            reason = PodReason.KILLED if exit_code == 128 + signal.SIGKILL else PodReason.ERROR
            message = _with_tail(how, list(pod.stderr_tail))
        with self._lock:
            self._finish(pod, phase, reason, exit_code, message)
            self._waiters.discard(threading.current_thread())

    def _finish(
        self, pod: _LocalPod, phase: PodPhase, reason: str, exit_code: int | None, message: str
    ) -> None:
        """Record and report a pod's terminal event and remove its folder. Called with the lock held."""
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
        shutil.rmtree(pod.folder, ignore_errors=True)
        self._queue.put(_event(pod.spec, phase, reason, exit_code, message))

    def _schedule_kill(self, pod: _LocalPod, grace_seconds: float) -> None:
        """SIGKILL the pod's group ``grace_seconds`` from now, unless that is already due sooner."""
        assert pod.pgid is not None
        deadline = time.monotonic() + max(grace_seconds, 0.0)
        if deadline >= pod.kill_deadline:
            return
        pod.kill_deadline = deadline
        if pod.kill_timer is not None:
            pod.kill_timer.cancel()
        if grace_seconds <= 0:
            _signal_group(pod.pgid, signal.SIGKILL)
            return
        pod.kill_timer = threading.Timer(grace_seconds, _signal_group, (pod.pgid, signal.SIGKILL))
        pod.kill_timer.daemon = True
        pod.kill_timer.start()


class _FileTail:
    """The complete lines appended to a file since the last call (a partial last line waits)."""

    def __init__(self, file: BinaryIO, offset: int) -> None:
        self._file = file
        self._file.seek(offset)
        self._partial = b""

    def lines(self, final: bool) -> Iterator[str]:
        """New whole lines (longer ones in pieces of ``_MAX_LINE_BYTES``); ``final``: the partial too."""
        while data := self._file.read(_READ_BYTES):
            *whole, self._partial = (self._partial + data).split(b"\n")
            for line in whole:
                yield from _pieces(line)
            while len(self._partial) >= _MAX_LINE_BYTES:
                yield _decode(self._partial[:_MAX_LINE_BYTES])
                self._partial = self._partial[_MAX_LINE_BYTES:]
        if final and self._partial:
            yield from _pieces(self._partial)
            self._partial = b""


def _pieces(line: bytes) -> Iterator[str]:
    for start in range(0, max(len(line), 1), _MAX_LINE_BYTES):
        yield _decode(line[start : start + _MAX_LINE_BYTES])


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").rstrip("\r")


def _spawn(target: Callable[..., None], name: str, *args: object) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, args=args, daemon=True)
    thread.start()
    return thread


def _event(
    spec: PodSpec, phase: PodPhase, reason: str, exit_code: int | None = None, message: str = ""
) -> PodEvent:
    return PodEvent(spec.role, spec.pod_id, phase, exit_code, reason, message, time.time())


def _signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group; a group that no longer exists is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _start_ticks(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), ``""`` where there is no /proc,
    or None if it does not exist or is a zombie (dead, not yet reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _read_record(folder: Path) -> PodSpec | None:
    """The spec a pod folder's ``pod.json`` describes; None if it is missing or unreadable."""
    try:
        record: dict[str, Any] = json.loads((folder / RECORD_FILE).read_text())
        return PodSpec(
            PodRole(record["role"]),
            int(record["pod_id"]),
            tuple(record["command"]),
            env=record["env"],
            port=record["port"],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_supervisor(folder: Path) -> tuple[int, str] | None:
    """``(pid, start ticks)`` of a pod's supervisor; None if it never wrote them."""
    try:
        record = json.loads((folder / SUPERVISOR_FILE).read_text())
        return int(record["pgid"]), str(record["start_ticks"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_exit(folder: Path) -> int | None:
    """The exit status the supervisor recorded (``-N``: signal N); None while there is none."""
    try:
        return int((folder / EXIT_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _last_lines(path: Path, end: int) -> list[str]:
    """The last :data:`STDERR_TAIL_LINES` whole lines of the file before byte ``end``."""
    try:
        with open(path, "rb") as file:
            file.seek(max(0, end - _STDERR_TAIL_BYTES))
            data = file.read(min(end, _STDERR_TAIL_BYTES))
    except OSError:
        return []
    lines = data.split(b"\n")
    if end > _STDERR_TAIL_BYTES:
        lines = lines[1:]  # probably cut
    return [_decode(line) for line in lines if line][-STDERR_TAIL_LINES:]


def _resolve_program(program: str, path: str | None) -> str:
    """The executable file ``program`` names: from this interpreter's ``bin`` directory if it is a bare
    name found there, else ``program`` itself or its match on ``path``. FileNotFoundError if none."""
    if os.sep in program or (os.altsep and os.altsep in program):
        found: str | None = program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    else:
        beside = Path(sys.executable).parent / program
        found = str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None
        found = found or shutil.which(program, path=path)
    if found is None:
        raise FileNotFoundError(errno.ENOENT, "no such executable file", program)
    return found


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
