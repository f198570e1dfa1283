"""Local pods forked from a template process that has already imported TensorFlow (a "zygote").

A pod command of our own program (``edl-argo worker ...`` or ``edl-argo ps ...``) spends 4.5-6 s of a core
importing TensorFlow before it does anything. :class:`PodTemplate` runs one process per backend,
:mod:`edl_argo.zygote`, that imports it (with gRPC and the worker's and PS's modules) once and then forks
each such pod's supervisor on request; the supervisor forks the command, which runs the CLI in-process. A
pod is then the same process group as one started with ``exec`` (:mod:`edl_argo.pods.supervisor`), with
the same folder, files and exit statuses, and a later backend adopts it the same way.

**What is safe to fork.** A fork copies only the calling thread; a thread that held a lock at that moment
leaves it locked for ever in the child. So the template forks only while it runs no thread besides its
main one (it counts ``/proc/self/task`` before every fork, and answers "use exec" otherwise) and before it
has run any TensorFlow op or created any gRPC channel or server (TensorFlow's and gRPC's thread pools start
with their first use, in the pod). Importing TensorFlow and gRPC starts no thread; importing NumPy starts
OpenBLAS's pool (one thread per core), which the template shuts down with OpenBLAS's own
``blas_thread_shutdown_`` (what OpenBLAS's ``pthread_atfork`` handler does at every fork anyway), waiting
at most a second for its threads to be gone (one may be listed a moment after the call returned): the pod's
first BLAS call starts the pool again, as large as in a process of its own. The pod reseeds NumPy's global
random state (Python's ``random`` reseeds itself after a fork); the hash seed of ``str`` is the template's.

**Environment.** The pod's ``os.environ`` (and so the C environment) is exactly its own, plus the variables
that importing TensorFlow sets (``TF2_BEHAVIOR`` ...), as in a process that imported it itself. What a
process reads only while it starts or imports (:func:`import_time_environment`: ``PYTHON*``, ``TF_*``,
``TF_CPP_MIN_LOG_LEVEL`` as ``quiet_native_logs`` sets it, thread-pool and allocator settings, locale,
``HOME``, the temporary folder ...) cannot change after the fork: a pod whose values differ from the
template's is started with ``exec``. So is every other command (``sleep``, ``python -c``, another
program's ``edl-argo``). Note that ``/proc/PID/environ`` of a forked pod shows the template's start
environment, whose ``EDL_JOB_NAME`` is that of the job it was started for (the first local job of the
process, for :func:`process_template`).

**Lifecycle.** A template starts with the first start of an ``edl-argo`` pod (the start waits for it to
be ready, at most :data:`BOOT_SECONDS`), or in the background with :meth:`PodTemplate.start_in_background`,
and stops with :meth:`PodTemplate.close`; it exits by itself as soon as its owner's end of their socket
closes (the master ended, however it ended) or its parent changed. A backend's own template is closed
with the backend. The local jobs of one process share :func:`process_template`, which outlives each of
them and stops when the process exits: the second job's pods do not wait for TensorFlow's import again.

Requests (JSON with ``argv``, ``env``, ``cwd`` and ``folder``, and the write end of a pipe that only the
supervisor keeps, so that its read end reaches end-of-file when the supervisor exits) travel over a
``SOCK_SEQPACKET`` socket pair with deadlines. If the template cannot start, dies, or fails a request,
the backend says so in one log line and starts every later pod with ``exec``.

**Setting.** ``EDL_LOCAL_PREFORK=0`` (or ``false``, ``no``, ``off``) in the master's environment switches
the template off: every pod is started with ``exec``.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn

from edl_argo.log import get_logger
from edl_argo.pods.supervisor import supervise
from edl_argo.rpc.auth import CREDENTIAL_ENV

log = get_logger(__name__)

PREFORK_ENV = "EDL_LOCAL_PREFORK"
"""``0``, ``false``, ``no`` or ``off``: no template; every local pod starts with ``exec``."""

PROGRAM = "edl-argo"
"""The program whose pod commands the template runs (the one beside this interpreter)."""

BOOT_SECONDS = 120.0
"""How long the first pod start waits for the template to import everything."""

REQUEST_SECONDS = 10.0
"""How long a request to the template, and the forked supervisor's first sign of life, may take."""

STOP_SECONDS = 5.0
"""How long :meth:`PodTemplate.close` waits for the template to exit before killing it."""

_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_PARENT_CHECK_SECONDS = 0.5

#: Prefixes and names of the variables a process reads only as it starts or imports its modules.
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "TF_",
    "TF2_",
    "KERAS_",
    "XLA_",
    "CUDA_",
    "NVIDIA_",
    "OMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO_",
    "GRPC_",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "LC_",
)
IMPORT_TIME_NAMES = frozenset({"LANG", "LANGUAGE", "HOME", "TZ", "TMPDIR", "TEMP", "TMP"})


def prefork_enabled(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` lets local pods be forked from a template (:data:`PREFORK_ENV`)."""
    return environ.get(PREFORK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def is_import_time(name: str) -> bool:
    """Whether a process reads variable ``name`` only as it starts or imports (see the module docstring)."""
    return name in IMPORT_TIME_NAMES or name.startswith(IMPORT_TIME_PREFIXES)


def import_time_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` that :func:`is_import_time` names."""
    return {name: value for name, value in environ.items() if is_import_time(name)}


def pod_base_environment() -> dict[str, str]:
    """Every local pod's environment before its own variables: this process's without its credentials
    (:data:`~edl_argo.rpc.auth.CREDENTIAL_ENV`), :func:`unbuffered` (so Python pods' logs arrive as they
    are written). The template (and a warm server) starts with it."""
    return unbuffered({name: value for name, value in os.environ.items() if name not in CREDENTIAL_ENV})


def unbuffered(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with ``PYTHONUNBUFFERED=1`` unless it sets it."""
    return {"PYTHONUNBUFFERED": "1", **environ}


_process_template: PodTemplate | None = None
_process_template_lock = threading.Lock()


def process_template(job_name: str) -> PodTemplate:
    """This process's template, shared by every local job it runs (one after another or at once), starting
    in the background on the first call, named after that call's job (``edl-argo train`` runs one job: its
    pods' ``/proc/PID/environ`` names it). It starts with :func:`pod_base_environment` of that moment (a
    later job whose import-time variables differ has its pods started with ``exec``, as the template
    answers) and stops when the process exits. One that failed or was closed is replaced by a new one.

    Where this user's warm server serves this process (:mod:`edl_argo.pods.warm`), the template is a
    connection to it instead: nothing is imported again."""
    from edl_argo.pods.warm import serving_socket  # warm builds on this module

    global _process_template
    with _process_template_lock:
        if _process_template is None or not _process_template.usable:
            _process_template = PodTemplate(job_name, pod_base_environment, server=serving_socket(os.environ))
            _process_template.start_in_background()
            atexit.register(_process_template.close)
        return _process_template


def template_program() -> str:
    """The path of the program whose pods the template runs: ``edl-argo`` beside this interpreter."""
    return str(Path(sys.executable).parent / PROGRAM)


@dataclass(frozen=True)
class ForkRequest:
    """What the template needs to start one pod: its command line (``argv[0]`` the program's path), its
    whole environment, its working directory and its folder; and whether the requester ignores SIGINT
    (:func:`sigint_ignored`)."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    folder: str
    sigint_ignored: bool = False

    def encode(self) -> bytes:
        record = {"argv": self.argv, "env": self.env, "cwd": self.cwd, "folder": self.folder}
        return json.dumps({**record, "sigint_ignored": self.sigint_ignored}).encode()

    @classmethod
    def decode(cls, data: bytes) -> ForkRequest:
        """The request ``data`` encodes; ValueError if it is not one."""
        record = json.loads(data)
        if not isinstance(record, dict):
            raise ValueError("a request is a JSON object")
        return cls(
            command_line(record.get("argv")),
            environment(record.get("env")),
            text(record.get("cwd"), "cwd"),
            text(record.get("folder"), "folder"),
            flag(record.get("sigint_ignored", False), "sigint_ignored"),
        )


def sigint_ignored() -> bool:
    """Whether this process ignores SIGINT (Python keeps an ignored SIGINT it inherits: a shell script's
    background job). A process it execs ignores it too, so one forked for it must (:class:`ForkRequest`,
    :class:`~edl_argo.pods.warm.CommandRequest`)."""
    return signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def command_line(value: object) -> tuple[str, ...]:
    """``value`` as a command line (a non-empty list of strings); ValueError if it is not one."""
    if not isinstance(value, list) or not value or not all(isinstance(arg, str) for arg in value):
        raise ValueError("argv is not a non-empty list of strings")
    return tuple(value)


def environment(value: object) -> dict[str, str]:
    """``value`` as an environment (strings by string); ValueError if it is not one."""
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError("env is not an object of strings")
    return dict(value)


def flag(value: object, name: str) -> bool:
    """``value`` if it is a boolean; ValueError naming the field ``name`` otherwise."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} is not true or false")
    return value


def text(value: object, name: str) -> str:
    """``value`` if it is a string; ValueError naming the field ``name`` otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"{name} is not a string")
    return value


@dataclass(frozen=True)
class ForkedSupervisor:
    """A pod supervisor the template forked: its pid (the pod's process group) and the read end of the
    pipe that reaches end-of-file when it exits (the caller closes it)."""

    pid: int
    exit_pipe: int


class TemplateError(Exception):
    """The template cannot be used: it did not start, died, or failed a request."""


class PodTemplate:
    """The backend's side of its template process (see the module docstring). Thread-safe.

    Args:
        job_name: the name of the job it is started for, in its log lines and in the template's
            environment as ``EDL_JOB_NAME``.
        environment: called once, when the template starts: the environment it starts with (the backend's
            pods' environment before their own variables).
        enabled: False: :meth:`serves` is always False and no process is ever started.
        server: the socket of a warm server (:mod:`edl_argo.pods.warm`) to connect to instead of starting
            a process; if it cannot be reached, the template is abandoned as one that cannot start.
    """

    def __init__(
        self,
        job_name: str,
        environment: Callable[[], dict[str, str]],
        enabled: bool = True,
        server: Path | None = None,
    ) -> None:
        self.job_name = job_name
        self._environment = environment
        self._server = server
        self._server_pid: int | None = None
        self._usable = enabled
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._channel: socket.socket | None = None
        self._stderr: IO[bytes] | None = None
        self._ready = False

    def serves(self, program: str) -> bool:
        """Whether a pod running ``program`` (a path) is offered to the template (it may still answer
        "use exec"): the template is enabled, has not failed, and ``program`` is :func:`template_program`."""
        return self._usable and program == template_program()

    def warm_up(self) -> None:
        """Start the template unless it runs, and wait until it is ready (at most :data:`BOOT_SECONDS`).
        A template that cannot start is abandoned (one log line): :meth:`serves` is False from then on."""
        with self._lock:
            if not self._usable or self._channel is not None:
                return
            try:
                self._boot()
            except (OSError, TemplateError, ValueError) as error:
                self._abandon(f"cannot start the pod template: {error}")

    def start_in_background(self) -> None:
        """:meth:`warm_up` in a thread of its own: the template imports while this process works on. A
        warm server's connection is made by the first :meth:`fork` instead (it takes milliseconds)."""
        if self._usable and self._server is None:
            threading.Thread(target=self.warm_up, name="pod-template-start", daemon=True).start()

    def fork(self, request: ForkRequest) -> ForkedSupervisor | None:
        """Have the template start a pod; None if it answers "use exec" or has failed (then abandoned).

        Returns once the supervisor runs in its own session with its output files open."""
        self.warm_up()
        with self._lock:
            if not self._usable or self._channel is None:
                return None
            read_end, write_end = os.pipe()
            try:
                try:
                    socket.send_fds(self._channel, [request.encode()], [write_end])
                except OSError as error:
                    if error.errno != errno.EMSGSIZE:
                        raise
                    log.debug("pod_template_declined", job=self.job_name, reason="the request is too large")
                    os.close(read_end)
                    return None
                finally:
                    os.close(write_end)
                reply = json.loads(receive_message(self._channel, REQUEST_SECONDS))
                if "exec" in reply:
                    log.debug("pod_template_declined", job=self.job_name, reason=reply["exec"])
                    os.close(read_end)
                    return None
                pid = int(reply["pid"])
                if _read_line(read_end, REQUEST_SECONDS) != str(pid):
                    raise TemplateError(f"the supervisor it forked (pid {pid}) exited before it was ready")
                return ForkedSupervisor(pid, read_end)
            except (OSError, TemplateError, ValueError, KeyError, TypeError) as error:
                command = " ".join(request.argv[1:2])
                self._abandon(f"the pod template failed to start a pod ({command}): {error}")
                _kill_stray_supervisor(read_end)
                os.close(read_end)
                return None

    @property
    def usable(self) -> bool:
        """Whether the template may still serve: enabled, not failed and not closed."""
        return self._usable

    @property
    def ready(self) -> bool:
        """Whether the template is up and usable: :meth:`fork` would not wait for it to start."""
        return self._usable and self._ready

    @property
    def pid(self) -> int | None:
        """The template's pid while it runs (for tests): the warm server's, when it is one."""
        with self._lock:
            if self._server_pid is not None:
                return self._server_pid
            return None if self._process is None else self._process.pid

    def close(self) -> None:
        """Stop the template (its pods keep running): close its socket, wait at most :data:`STOP_SECONDS`,
        then kill it. One still importing is killed at once (its start, in another thread, then fails
        without a word)."""
        self._usable = False
        booting = self._process  # set before a start waits for the template to be ready
        if booting is not None and self._channel is not None and not self._ready:
            booting.kill()
        with self._lock:
            self._stop()

    # -- internals (with the lock held) ----------------------------------------------------------------

    def _boot(self) -> None:
        if self._server is not None:
            self._channel, self._server_pid = connect_template(self._server, REQUEST_SECONDS)
            self._ready = True
            log.info(
                "pod_template_ready", job=self.job_name, pid=self._server_pid, warm_server=str(self._server)
            )
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._channel = mine
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - open while the template runs
        env = self._environment()
        env["EDL_JOB_NAME"] = self.job_name
        # sys.path[0] as in the program beside this interpreter (not the working directory of ``-c``).
        bin_dir = str(Path(sys.executable).parent)
        boot = f"import sys; sys.path[0] = {bin_dir!r}; import edl_argo.zygote as z; z.main()"
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", boot, str(theirs.fileno())],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        finally:
            theirs.close()
        if not self._usable:
            raise TemplateError("the backend closed")
        started = time.monotonic()
        reply = json.loads(receive_message(mine, BOOT_SECONDS, what="the pod template to be ready"))
        if "error" in reply:
            raise TemplateError(str(reply["error"]))
        self._ready = True
        seconds = round(time.monotonic() - started, 2)
        log.info("pod_template_ready", job=self.job_name, pid=self._process.pid, seconds=seconds)

    def _abandon(self, reason: str) -> None:
        if self._usable:
            tail = self._stderr_tail()
            log.warning(
                "pod_template_unavailable",
                job=self.job_name,
                error=reason + (f" (its stderr: {tail})" if tail else ""),
                consequence="pods start with exec",
            )
        self._usable = False
        self._stop()

    def _stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._process is not None:
            if not self._ready:
                self._process.kill()  # still importing: it has no pod to see through, and would import on
            try:
                self._process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._stderr is not None:
            self._stderr.close()
        self._channel = self._process = self._stderr = None
        self._server_pid = None

    def _stderr_tail(self) -> str:
        """The last line the template wrote to stderr (it exits first if it is dying)."""
        if self._stderr is None:
            return ""
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(0.5)
        with contextlib.suppress(OSError, ValueError):
            self._stderr.seek(0)
            lines = self._stderr.read().decode("utf-8", errors="replace").strip().splitlines()
            return lines[-1][:500] if lines else ""
        return ""


# -- the template's side -------------------------------------------------------------------------------


def serve(
    channel: socket.socket,
    decline: Callable[[ForkRequest], str | None],
    run_command: Callable[[ForkRequest], object],
) -> NoReturn:
    """The template's loop: answer each request on ``channel`` with ``{"exec": reason}`` if
    ``decline(request)`` gives a reason (or this process runs another thread), else fork the pod's
    supervisor (its command: ``run_command(request)``) and answer ``{"pid": pid}``. Exits when the
    channel closes or the parent changes. Reaps the supervisors it forked."""
    parent = os.getppid()
    channel.setblocking(True)
    while True:
        _reap_children()
        readable, _, _ = select.select([channel], [], [], _PARENT_CHECK_SECONDS)
        if os.getppid() != parent:
            os._exit(0)
        if not readable:
            continue
        try:
            message, descriptors, _, _ = socket.recv_fds(channel, _MAX_MESSAGE_BYTES, 1)
        except OSError:
            os._exit(0)
        if not message:
            os._exit(0)
        if len(descriptors) != 1:
            for descriptor in descriptors:
                os.close(descriptor)
            _answer(channel, {"exec": "the request carried no exit pipe"})
            continue
        _answer(channel, start_pod(message, descriptors[0], decline, run_command, channel.close))


def fork_unless(reason: str | None, child: Callable[[], object]) -> int | str:
    """Fork a process that runs ``child`` (and exits 127 should it return) unless there is a ``reason``
    not to or this process runs another thread (see the module docstring): its pid, or the reason."""
    threads = running_threads()
    if reason is None and threads > 1:
        reason = f"the template runs {threads} threads"
    if reason is not None:
        return reason
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            child()
        finally:
            os._exit(127)
    return pid


def running_threads() -> int:
    """How many threads this process runs (``/proc/self/task``)."""
    return len(os.listdir("/proc/self/task"))


THREADS_SETTLE_SECONDS = 1.0
"""How long a template that has just stopped threads (OpenBLAS's pool) waits for them to be gone."""


def threads_once_settled(seconds: float = THREADS_SETTLE_SECONDS) -> int:
    """:func:`running_threads`, once the threads that are ending have ended (or ``seconds`` passed): a
    thread told to stop may still be listed a moment after the call that stopped it returned."""
    deadline = time.monotonic() + seconds
    while (threads := running_threads()) > 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    return threads


def start_pod(
    message: bytes,
    exit_pipe: int,
    decline: Callable[[ForkRequest], str | None],
    run_command: Callable[[ForkRequest], object],
    close_in_child: Callable[[], object],
) -> dict[str, object]:
    """Fork the supervisor of the pod ``message`` asks for (unless ``decline`` gives a reason or this
    process runs another thread): the answer to send, ``{"pid": pid}`` or ``{"exec": reason}``. The child
    first calls ``close_in_child`` (the template's sockets). Closes ``exit_pipe`` here."""
    try:
        request = ForkRequest.decode(message)

        def supervisor() -> None:
            close_in_child()
            _become_supervisor(request, exit_pipe, run_command)

        forked = fork_unless(decline(request), supervisor)
        return {"pid": forked} if isinstance(forked, int) else {"exec": forked}
    except (OSError, ValueError, KeyError, TypeError) as error:
        return {"exec": f"cannot fork: {error}"}
    finally:
        os.close(exit_pipe)


def _become_supervisor(
    request: ForkRequest, exit_pipe: int, run_command: Callable[[ForkRequest], object]
) -> NoReturn:
    """In the forked child: a session of its own, stdin from /dev/null, the output files on descriptors 1
    and 2 (as the exec path's ``Popen`` arranges), the pid on the exit pipe, then :func:`supervise`."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for descriptor, name in ((1, "stdout"), (2, "stderr")):
        opened = os.open(os.path.join(request.folder, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(opened, descriptor)
        os.close(opened)
    os.write(exit_pipe, f"{os.getpid()}\n".encode())
    supervise(request.folder, lambda: run_command(request), close_in_command=(exit_pipe,))


def _reap_children() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _answer(channel: socket.socket, reply: Mapping[str, object]) -> None:
    try:
        channel.send(json.dumps(reply).encode())
    except OSError:
        os._exit(0)


def send_ready(channel: socket.socket, error: str | None = None) -> None:
    """The template's first message: ready, or the one-line reason it cannot serve."""
    _answer(channel, {"ready": os.getpid()} if error is None else {"error": error})


# -- helpers ---------------------------------------------------------------------------------------------


def receive_message(channel: socket.socket, seconds: float, what: str = "the pod template's answer") -> bytes:
    """One message from ``channel`` within ``seconds``; TemplateError on a timeout or a closed channel."""
    readable, _, _ = select.select([channel], [], [], seconds)
    if not readable:
        raise TemplateError(f"no answer within {seconds:g} s waiting for {what}")
    message = channel.recv(_MAX_MESSAGE_BYTES)
    if not message:
        raise TemplateError(f"the pod template exited while waiting for {what}")
    return message


def connect_template(path: Path, seconds: float) -> tuple[socket.socket, int]:
    """A connection to the template (a warm server: :mod:`edl_argo.pods.warm`) listening at ``path``, and
    its pid from its greeting, within ``seconds``. Raises TemplateError if there is none, or if the process
    listening there is another user's (it would see this process's environment and descriptors)."""
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        channel.settimeout(seconds)
        channel.connect(str(path))
        channel.settimeout(None)
        listener_uid = peer_uid(channel)
        if listener_uid != os.getuid():
            raise TemplateError(f"the process listening there runs as user {listener_uid}")
        greeting = json.loads(receive_message(channel, seconds, what="the warm server's greeting"))
        return channel, int(greeting["ready"])
    except (OSError, TemplateError, ValueError, KeyError, TypeError) as error:
        channel.close()
        raise TemplateError(f"no warm server at {path}: {error}") from error


def peer_uid(channel: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    credentials = channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", credentials)[1])


def _read_line(descriptor: int, seconds: float) -> str:
    """The first line written to a pipe within ``seconds`` ("" at end-of-file or a timeout)."""
    data = b""
    deadline = time.monotonic() + seconds
    while b"\n" not in data:
        readable, _, _ = select.select([descriptor], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            return ""
        chunk = os.read(descriptor, 64)
        if not chunk:
            return ""
        data += chunk
    return data.split(b"\n", 1)[0].decode()


def _kill_stray_supervisor(exit_pipe: int) -> None:
    """After the template was stopped in the middle of a request: kill the group of a supervisor it may
    have forked (which writes its pid to the pipe, whose other ends are then all closed)."""
    line = _read_line(exit_pipe, 1.0)
    if line.isdigit():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(line), signal.SIGKILL)


def wait_exit_pipe(exit_pipe: int) -> None:
    """Block until the pipe of a forked supervisor reaches end-of-file (it exited), then close it."""
    try:
        while os.read(exit_pipe, 64):
            pass
    finally:
        os.close(exit_pipe)
