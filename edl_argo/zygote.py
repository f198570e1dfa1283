"""The pod template ("zygote") of a local backend: a process that imports what ``edl-argo worker`` and
``edl-argo ps`` import, then forks pods on request (:mod:`edl_argo.pods.prefork` states the contract).

Started by :class:`edl_argo.pods.prefork.PodTemplate` as ``python -c ... FD``, FD being its end of the
socket pair. It imports TensorFlow as a pod does (:func:`edl_argo.cli.quiet_native_logs`, then
:func:`edl_argo.tensorflow_import.import_tensorflow`), gRPC and the pods' modules, stops OpenBLAS's threads,
checks that it runs no other thread, freezes its objects for the collector (``gc.freeze``), says it is
ready, and serves. A forked pod's command resets the signal dispositions of a new interpreter, takes its
own environment, directory, ``sys.argv`` and NumPy random state, and runs
:func:`edl_argo.cli.run_forked`.

:func:`main_warm` is the same process as a warm server (:mod:`edl_argo.pods.warm`): it also imports the
master's modules, listens on a socket of its own and also forks the commands its clients run.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from edl_argo import cli, log
from edl_argo.flags import command_in
from edl_argo.pods.prefork import (
    ForkRequest,
    import_time_environment,
    send_ready,
    serve,
    threads_once_settled,
    unbuffered,
)
from edl_argo.pods.warm import WARM_COMMANDS, CommandRequest
from edl_argo.pods.warm_server import serve_warm
from edl_argo.tensorflow_import import import_tensorflow

_log = log.get_logger(__name__)


def main() -> NoReturn:
    """The template's program: ``sys.argv[1]`` is the descriptor of its socket."""
    channel = socket.socket(fileno=int(sys.argv[1]))
    template, error = prepare()
    if template is None:
        send_ready(channel, error)
        os._exit(1)
    send_ready(channel)
    serve(channel, template.decline, template.run_command)


def main_warm() -> NoReturn:
    """The warm server's program (:mod:`edl_argo.pods.warm`): ``sys.argv[1]`` is the path of its socket,
    ``sys.argv[2]`` how many seconds it may stay idle. It imports what the master and the pods import,
    binds the socket under a name of its own, then renames it to the path (a client never finds a
    socket that does not answer yet), and serves."""
    path, idle_seconds = Path(sys.argv[1]), float(sys.argv[2])
    log.configure(None)
    template, error = prepare(warm_modules=True)
    if template is None:
        print(f"edl-argo warm: error: {error}", file=sys.stderr)
        os._exit(1)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    bound = path.with_name(f"{os.getpid()}.binding")
    with contextlib.suppress(FileNotFoundError):
        bound.unlink()
    listener.bind(str(bound))
    bound.chmod(0o600)
    listener.listen(64)
    os.replace(bound, path)
    _log.info(
        "warm_server_ready", pid=os.getpid(), socket=str(path), idle_minutes=round(idle_seconds / 60, 2)
    )
    serve_warm(listener, path, template, idle_seconds)


def prepare(warm_modules: bool = False) -> tuple[Template | None, str]:
    """Import what the pods import (and with ``warm_modules``, what the commands a warm server runs
    import), stop OpenBLAS's threads, check that no other thread runs, and freeze the objects for the
    collector: the template, or None and why it cannot serve."""
    before = dict(os.environ)
    try:
        cli.quiet_native_logs(None)
        imported_with = import_time_environment(os.environ)
        import_tensorflow()
        import grpc  # noqa: F401
        import numpy  # noqa: F401

        import edl_argo.ps.server
        import edl_argo.ps.servicer
        import edl_argo.worker.main  # noqa: F401

        if warm_modules:
            for name in WARM_MODULES:
                importlib.import_module(name)
        stop_openblas_threads()
    except Exception as error:
        return None, f"cannot import the pods' modules: {type(error).__name__}: {error}"
    set_by_imports = {name: value for name, value in os.environ.items() if before.get(name) != value}
    set_by_imports.pop("TF_CPP_MIN_LOG_LEVEL", None)
    threads = threads_once_settled()
    if threads > 1:
        return None, f"it runs {threads} threads once its modules are imported"
    # The imported modules' objects out of the collector's reach: a pod's collections then do not write to
    # (and so copy) the pages it shares with the template.
    gc.freeze()
    return Template(imported_with, set_by_imports), ""


#: What the commands of a warm server import once they run (their command modules and what they import
#: inside functions), imported by the server first.
WARM_MODULES = (
    "edl_argo.master.command",
    "edl_argo.master.job",
    "edl_argo.master.export",
    "edl_argo.inference",
    "edl_argo.sqlflow.command",
    "edl_argo.collective.learning_rate",
    "edl_argo.worker.data",
)


def stop_openblas_threads() -> None:
    """Shut down the thread pool of every OpenBLAS this process loaded (restarted by its next BLAS call)."""
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]}
    for library in sorted(libraries):
        shutdown = getattr(ctypes.CDLL(library), "blas_thread_shutdown_", None)
        if shutdown is not None:
            shutdown()


class Template:
    """Which requests the template serves, and what a forked pod's (or a warm server's command's) process
    does."""

    def __init__(self, imported_with: dict[str, str], set_by_imports: dict[str, str]) -> None:
        self.imported_with = imported_with
        self.set_by_imports = set_by_imports

    def decline(self, request: ForkRequest) -> str | None:
        """Why pod ``request`` must be started with exec, or None: see :meth:`_decline`."""
        return self._decline(request.argv[1:], request.env, cli.POD_COMMANDS)

    def decline_command(self, request: CommandRequest) -> str | None:
        """Why the client must run ``request`` itself, or None: see :meth:`_decline`."""
        return self._decline(request.argv[1:], request.env, WARM_COMMANDS)

    def _decline(
        self, args: Sequence[str], environ: Mapping[str, str], commands: frozenset[str]
    ) -> str | None:
        """Why ``edl-argo ARGS`` cannot be forked from here: its command is not one of ``commands``, or
        an import-time variable of ``environ`` differs from this process's (a variable the imports set
        may be there with the value they set)."""
        command = command_in(args)
        if command not in commands:
            return f"{command} is not a command this process runs"
        env = unbuffered(environ)  # as a template and a warm server start (pod_base_environment)
        env["TF_CPP_MIN_LOG_LEVEL"] = cli.native_min_log_level(cli.log_level_in(args), environ)
        wanted = import_time_environment(env)
        differing = sorted(
            name
            for name in (wanted.keys() | self.imported_with.keys()) - self.set_by_imports.keys()
            if wanted.get(name) != self.imported_with.get(name)
        )
        # What the imports set, the pod may have already, with the value they set.
        differing += sorted(
            name for name, value in self.set_by_imports.items() if env.get(name, value) != value
        )
        if differing:
            return "its environment differs from the template's in " + ", ".join(differing)
        return None

    def run_command(self, request: ForkRequest) -> NoReturn:
        """In the pod's forked command process: become ``request``'s command and run it."""
        self._become(request.argv, request.env, request.cwd, request.sigint_ignored)

    def run_warm_command(self, request: CommandRequest) -> NoReturn:
        """In a warm server's forked command process: become ``request``'s command and run it."""
        self._become(request.argv, request.env, request.cwd, request.sigint_ignored)

    def _become(
        self, argv: Sequence[str], environ: Mapping[str, str], cwd: str, ignore_sigint: bool
    ) -> NoReturn:
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT):
            signal.signal(number, signal.SIG_DFL)
        for number in (signal.SIGPIPE, signal.SIGXFSZ):  # as the interpreter sets them when it starts
            signal.signal(number, signal.SIG_IGN)
        # As a new interpreter sets it, keeping it ignored where the requester ignores it (exec would).
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.default_int_handler)
        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(self.set_by_imports)
        os.chdir(cwd)
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(argv[0])
        import numpy

        numpy.random.seed()
        cli.run_forked(argv[1:])
