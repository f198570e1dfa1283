"""A warm server: TensorFlow imported once for a user's successive local commands.

Importing TensorFlow takes 2.5-6 s of a core, and a local ``edl-argo train`` imports it twice before its
first step: in the master (to load the model file) and in its pod template (:mod:`edl_argo.pods.prefork`).
``edl-argo warm`` starts one process that has imported it, the pods' modules and the master's, and that
stays up until it has been idle for ``--idle-minutes``. While it runs, each ``edl-argo train``,
``evaluate``, ``predict`` and ``sql`` of the same user and installation (:data:`WARM_COMMANDS`) is forked
from it instead of importing anything (:func:`run_in_warm_server`), and the pods of a job are forked from
it too (:func:`edl_argo.pods.prefork.process_template` connects to it instead of starting a template).

**The contract.** A command run warm behaves as it does cold: same argv, environment, working directory
and umask; its standard input, output and error are the client's own descriptors (passed over the
socket), so a terminal, a pipe or a file sees what it would; the client's exit status is the command's
(128 + N if a signal N ended it); SIGINT, SIGTERM and SIGHUP sent to the client go to the command. If the
client dies, the command gets SIGTERM, and its session SIGKILL :data:`ORPHAN_GRACE_SECONDS` later if it
still runs (as a container runtime kills what its step's process left). The command runs in a session of
its own, as a child of the server. What the server cannot honour it declines, and the client then runs
the command itself: a command not in :data:`WARM_COMMANDS`, or an import-time variable
(:func:`~edl_argo.pods.prefork.is_import_time`) that differs from the server's.

**Which server.** One per :func:`installation_key`: the interpreter, this package's version and source
files (their sizes and times) and the run dir. A changed source file or another virtualenv finds no
server and runs cold; so does a command whose import-time variables differ from the server's (a
``--log-level DEBUG``, which changes ``TF_CPP_MIN_LOG_LEVEL``, or another ``PYTHONPATH``): the server
declines it. The socket is ``<run dir>/warm/<key>.sock`` in a folder of the user's that only they can
enter; the server serves only connections of its own user, and a client talks only to a server of its
own user (``SO_PEERCRED``, both ways). ``EDL_WARM=0`` (or ``false``, ``no``,
``off``) keeps a command from using a server.

The server's side is :mod:`edl_argo.pods.warm_server` (its loop) and :func:`edl_argo.zygote.main_warm`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from edl_argo import __version__
from edl_argo.errors import ConfigError
from edl_argo.flags import add_flag, command_in, positive_number
from edl_argo.log import get_logger
from edl_argo.pods.prefork import (
    BOOT_SECONDS,
    REQUEST_SECONDS,
    TemplateError,
    command_line,
    connect_template,
    environment,
    flag,
    pod_base_environment,
    receive_message,
    sigint_ignored,
    template_program,
    text,
)
from edl_argo.run_dir import run_dir, warm_dir

log = get_logger(__name__)

WARM_ENV = "EDL_WARM"
"""``0``, ``false``, ``no`` or ``off``: run the command here even if a warm server serves it."""

WARM_COMMANDS = frozenset({"train", "evaluate", "predict", "sql"})
"""The commands a warm server runs: those that import TensorFlow and are run by people, one after another."""

IDLE_MINUTES = 30.0
"""How long a warm server waits, with no command running and no connection open, before it exits."""

ORPHAN_GRACE_SECONDS = 15.0
"""How long a command whose client died has, after SIGTERM, before its session gets SIGKILL."""

CONNECT_SECONDS = 2.0
"""How long a client waits to connect to a server and for its greeting before it runs the command itself."""

SOCKET_PATH_BYTES = 107
"""The longest path of a Unix socket (``sun_path`` less its terminating zero)."""

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals a client passes on to the command it runs warm."""

SCOPED_IDLE_SECONDS = 60.0
"""How long a :class:`ScopedServer`'s server stays up once its owner is gone without retiring it (killed)."""


def warm_enabled(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` lets a command use a warm server (:data:`WARM_ENV`)."""
    return environ.get(WARM_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def runs_warm(args: Sequence[str]) -> bool:
    """Whether ``edl-argo ARGS`` runs a command a warm server runs (:data:`WARM_COMMANDS`)."""
    return command_in(args) in WARM_COMMANDS


def installation_key() -> str:
    """What a server must share with a command it runs besides its import-time environment (see the
    module docstring), as 16 hex digits."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for part in (sys.executable, __version__, str(run_dir().resolve())):
        digest.update(part.encode() + b"\0")
    for path in sorted(package.rglob("*.py")):
        status = path.stat()
        digest.update(f"{path.relative_to(package)}:{status.st_size}:{status.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:16]


def socket_path() -> Path:
    """Where the server of this installation listens."""
    return warm_dir() / f"{installation_key()}.sock"


def bindable_socket_path() -> Path:
    """:func:`socket_path`; ConfigError if it is too long for a Unix socket."""
    path = socket_path()
    if len(os.fsencode(path)) > SOCKET_PATH_BYTES:
        raise ConfigError(
            f"the warm server's socket {path} is longer than {SOCKET_PATH_BYTES} bytes: "
            "set EDL_RUN_DIR to a shorter folder"
        )
    return path


def serving_socket(environ: Mapping[str, str]) -> Path | None:
    """The socket of this installation's server if ``environ`` lets a process use one and one answers
    there (within :data:`CONNECT_SECONDS`), else None."""
    connection = connect_server(environ)
    if connection is None:
        return None
    channel, path = connection
    channel.close()
    return path


def connect_server(environ: Mapping[str, str]) -> tuple[socket.socket, Path] | None:
    """A connection to this installation's server, greeted, and the server's socket, if ``environ`` lets a
    process use one and one answers (within :data:`CONNECT_SECONDS`), else None."""
    if not warm_enabled(environ):
        return None
    path = socket_path()
    if not path.exists():
        return None
    try:
        channel, _ = connect_template(path, CONNECT_SECONDS)
    except TemplateError:
        return None
    return channel, path


@dataclass(frozen=True)
class CommandRequest:
    """A command for the server to run: its command line (``argv[0]`` the program's path), whole
    environment, working directory, umask and whether the client ignores SIGINT
    (:func:`~edl_argo.pods.prefork.sigint_ignored`). Sent with the client's descriptors 0, 1 and 2."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    umask: int
    sigint_ignored: bool = False

    def encode(self, check: bool = False) -> bytes:
        """The request as sent; with ``check``, as a question whether the server would run it."""
        record = {"run": list(self.argv), "env": self.env, "cwd": self.cwd, "umask": self.umask}
        record["sigint_ignored"] = self.sigint_ignored
        return json.dumps({"check": True, **record} if check else record).encode()

    @classmethod
    def decode(cls, record: Mapping[str, Any]) -> CommandRequest:
        """The request ``record`` (a decoded JSON object) holds; ValueError if it is not one."""
        umask = record.get("umask")
        if not isinstance(umask, int) or not 0 <= umask <= 0o777:
            raise ValueError("umask is not a number from 0 to 0o777")
        argv = command_line(record.get("run"))
        return cls(
            argv,
            environment(record.get("env")),
            text(record.get("cwd"), "cwd"),
            umask,
            flag(record.get("sigint_ignored", False), "sigint_ignored"),
        )


# -- the client ----------------------------------------------------------------------------------------


def run_in_warm_server(argv: Sequence[str], command: str | None) -> int | None:
    """Run ``edl-argo ARGV`` (whose command is ``command``) in this user's warm server, if one serves it:
    its exit status; None if there is none or it declines (the caller then runs the command itself).

    Waits as long as the command runs: the server answers when the command ends, and a server that dies
    closes the connection, which ends the wait (status 1, one line on stderr)."""
    connection = connect_server(os.environ) if command in WARM_COMMANDS else None
    if connection is None:
        return None
    channel, _ = connection
    with channel:
        try:
            socket.send_fds(channel, [this_command(argv).encode()], [0, 1, 2])
            reply = json.loads(receive_message(channel, REQUEST_SECONDS, what="the warm server's answer"))
        except (OSError, TemplateError, ValueError):
            return None
        if "pid" not in reply:
            return None
        return _wait_for_command(channel, int(reply["pid"]))


def _wait_for_command(channel: socket.socket, pid: int) -> int:
    """Pass :data:`FORWARDED_SIGNALS` on to ``pid`` until the server reports its exit status."""

    def forward(number: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, number)

    previous = {number: signal.signal(number, forward) for number in FORWARDED_SIGNALS}
    try:
        message = channel.recv(4096)
    except OSError:
        message = b""
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if not message:
        print(
            f"edl-argo: error: the warm server ended while running the command (pid {pid})", file=sys.stderr
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        return 1
    return int(json.loads(message)["exit"])


# -- a server for the length of one piece of work -------------------------------------------------------


class ScopedServer:
    """A warm server for the length of one piece of work that runs several commands one after another (a
    pipeline run's steps), started only if none serves this installation already, and retired when the
    work ends: it takes no new client, and exits once the commands it runs have ended. One that serves
    already is used and left as it is.

    It starts in the background (:meth:`start`); :meth:`wait_until_ready` bounds the wait of a command
    that should run in it. It holds a connection while the work goes on, so it never exits idle under it;
    if the owner is killed, it exits :data:`SCOPED_IDLE_SECONDS` after. Starting is best effort: a server
    that cannot start is logged, and the commands run cold."""

    def __init__(self) -> None:
        self._channel: socket.socket | None = None
        self._starting: threading.Thread | None = None

    @classmethod
    @contextlib.contextmanager
    def around(cls, wanted: bool) -> Iterator[ScopedServer]:
        """A server (started if ``wanted``, the environment allows it and none serves) for the block."""
        server = cls()
        if wanted:
            server.start()
        try:
            yield server
        finally:
            server.retire()

    def start(self) -> None:
        if serving_socket(os.environ) is not None or not warm_enabled(os.environ):
            return  # one serves (this user's own, left as it is), or none is wanted
        self._starting = threading.Thread(target=self._start, name="warm-start", daemon=True)
        self._starting.start()

    def _start(self) -> None:
        try:
            path = bindable_socket_path()
            start_server(path, SCOPED_IDLE_SECONDS)
            self._channel, pid = connect_template(path, CONNECT_SECONDS)
        except (ConfigError, TemplateError) as error:
            log.warning("warm_server_not_started", error=str(error), consequence="commands import TensorFlow")
            return
        log.info("warm_server_started", pid=pid, socket=str(path))

    def wait_until_ready(self) -> None:
        """Wait (at most :data:`~edl_argo.pods.prefork.BOOT_SECONDS`) until a server this one is starting
        serves, or could not start."""
        if self._starting is not None:
            self._starting.join(BOOT_SECONDS)

    def retire(self) -> None:
        """Ask the server this one started to retire (see the class docstring)."""
        self.wait_until_ready()
        channel, self._channel = self._channel, None
        if channel is None:
            return
        with channel:
            try:
                channel.send(json.dumps({"retire": True}).encode())
                receive_message(channel, REQUEST_SECONDS, what="the warm server to retire")
            except (OSError, TemplateError) as error:
                log.warning("warm_server_not_retired", error=str(error))


# -- ``edl-argo warm`` ------------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "warm",
        help="keep TensorFlow imported for this user's next train, evaluate, predict and sql commands",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_flag(
        parser,
        "--idle-minutes",
        type=positive_number,
        default=IDLE_MINUTES,
        help=f"exit after this long with nothing to run (default {IDLE_MINUTES:g})",
    )
    add_flag(parser, "--stop", action="store_true", help="stop the warm servers of this run dir instead")
    add_flag(parser, "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(run=run_warm_command)


def run_warm_command(args: argparse.Namespace) -> int:
    """``edl-argo warm``: start this installation's server (unless it runs) and wait until it serves; with
    ``--stop``, stop every server of the run dir (:func:`stop_servers`). Prints one line."""
    if args.stop:
        return stop_servers()
    path = bindable_socket_path()
    try:
        channel, pid = connect_template(path, CONNECT_SECONDS)
    except TemplateError:
        channel, pid = None, 0
    if channel is not None:
        with channel:
            reason = refusal(channel)
        if reason:
            raise ConfigError(
                f"the warm server (pid {pid}) does not serve this environment: {reason}; "
                "stop it with 'edl-argo warm --stop', then start it again"
            )
        print(f"edl-argo warm: a warm server runs already (pid {pid}, {path})")
        return 0
    pid = start_server(path, args.idle_minutes * 60.0)
    print(f"edl-argo warm: ready (pid {pid}, {path}); it exits after {args.idle_minutes:g} min idle")
    return 0


def stop_servers() -> int:
    """Stop every warm server listening in this run dir (this installation's, and those of earlier
    versions or sources, which commands no longer find): prints one line."""
    stopped = []
    for path in sorted(warm_dir().glob("*.sock")):
        try:
            channel, pid = connect_template(path, CONNECT_SECONDS)
        except TemplateError:
            continue
        with channel:
            channel.send(json.dumps({"stop": True}).encode())
            with contextlib.suppress(TemplateError):
                receive_message(channel, REQUEST_SECONDS, what="the warm server to stop")
        stopped.append(str(pid))
    if stopped:
        print(f"edl-argo warm: stopped {len(stopped)} warm server(s) (pid {', '.join(stopped)})")
    else:
        print(f"edl-argo warm: no warm server runs in {warm_dir()}")
    return 0


def refusal(channel: socket.socket) -> str:
    """Why the server at the other end of ``channel`` would not run ``edl-argo train`` for this process
    (its environment), or ""."""
    channel.send(this_command(["train"]).encode(check=True))
    reply = json.loads(receive_message(channel, REQUEST_SECONDS, what="the warm server's answer"))
    return str(reply.get("exec", ""))


def this_command(argv: Sequence[str]) -> CommandRequest:
    """``edl-argo ARGV`` as this process would run it: its environment, directory and umask."""
    umask = os.umask(0)
    os.umask(umask)
    # The program beside the interpreter (the installation the key names), also for ``python -m``.
    program = (template_program(), *argv)
    return CommandRequest(program, dict(os.environ), os.getcwd(), umask, sigint_ignored())


def start_server(path: Path, idle_seconds: float) -> int:
    """Start a server that will listen at ``path`` (in a session of its own, not a child of anything that
    waits for it) and wait until it does, at most :data:`~edl_argo.pods.prefork.BOOT_SECONDS`: its pid.

    Raises:
        ConfigError: it could not start; the last line of its stderr says why.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner = path.parent.stat().st_uid
    if owner != os.getuid():
        raise ConfigError(
            f"the warm server's folder {path.parent} belongs to user {owner}, not to you: "
            "set EDL_RUN_DIR to a folder of your own"
        )
    path.parent.chmod(0o700)
    log_path = path.with_suffix(".log")
    bin_dir = str(Path(sys.executable).parent)
    boot = f"import sys; sys.path[0] = {bin_dir!r}; import edl_argo.zygote as z; z.main_warm()"
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-c", boot, str(path), repr(idle_seconds)],
            env=pod_base_environment(),  # what a template starts with
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
            start_new_session=True,
        )
    deadline = time.monotonic() + BOOT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            lines = log_path.read_text(errors="replace").strip().splitlines()
            raise ConfigError(
                f"the warm server exited at start: {lines[-1] if lines else process.returncode}"
            )
        with contextlib.suppress(TemplateError):
            channel, pid = connect_template(path, CONNECT_SECONDS)
            channel.close()
            return pid
        time.sleep(0.05)
    process.kill()
    process.wait()
    raise ConfigError(f"the warm server was not ready within {BOOT_SECONDS:g} s (its log: {log_path})")
