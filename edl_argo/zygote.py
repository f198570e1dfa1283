"""The pod template ("zygote") of a local backend: a process that imports what ``edl-argo worker`` and
``edl-argo ps`` import, then forks pods on request (:mod:`edl_argo.pods.prefork` states the contract).

Started by :class:`edl_argo.pods.prefork.PodTemplate` as ``python -c ... FD``, FD being its end of the
socket pair. It imports TensorFlow as a pod does (:func:`edl_argo.cli.quiet_native_logs`, then
:func:`edl_argo.tensorflow_import.import_tensorflow`), gRPC and the pods' modules, stops OpenBLAS's threads,
checks that it runs no other thread, freezes its objects for the collector (``gc.freeze``), says it is
ready, and serves. A forked pod's command resets the signal dispositions of a new interpreter, takes its
own environment, directory, ``sys.argv`` and NumPy random state, and runs
:func:`edl_argo.cli.run_forked_pod`.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import socket
import sys
from typing import NoReturn

from edl_argo import cli
from edl_argo.pods.prefork import (
    ForkRequest,
    import_time_environment,
    running_threads,
    send_ready,
    serve,
)
from edl_argo.tensorflow_import import import_tensorflow


def main() -> NoReturn:
    """The template's program: ``sys.argv[1]`` is the descriptor of its socket."""
    channel = socket.socket(fileno=int(sys.argv[1]))
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

        stop_openblas_threads()
    except Exception as error:
        send_ready(channel, f"cannot import the pods' modules: {type(error).__name__}: {error}")
        os._exit(1)
    set_by_imports = {name: value for name, value in os.environ.items() if before.get(name) != value}
    set_by_imports.pop("TF_CPP_MIN_LOG_LEVEL", None)
    threads = running_threads()
    if threads > 1:
        send_ready(channel, f"it runs {threads} threads once its modules are imported")
        os._exit(1)
    template = _Template(imported_with, set_by_imports)
    # The imported modules' objects out of the collector's reach: a pod's collections then do not write to
    # (and so copy) the pages it shares with the template.
    gc.freeze()
    send_ready(channel)
    serve(channel, template.decline, template.run_command)


def stop_openblas_threads() -> None:
    """Shut down the thread pool of every OpenBLAS this process loaded (restarted by its next BLAS call)."""
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]}
    for library in sorted(libraries):
        shutdown = getattr(ctypes.CDLL(library), "blas_thread_shutdown_", None)
        if shutdown is not None:
            shutdown()


class _Template:
    """Which requests the template serves, and what a forked pod's command does."""

    def __init__(self, imported_with: dict[str, str], set_by_imports: dict[str, str]) -> None:
        self.imported_with = imported_with
        self.set_by_imports = set_by_imports

    def decline(self, request: ForkRequest) -> str | None:
        """Why ``request`` must be started with exec, or None: it is not a pod command, or an
        import-time variable of its environment differs from this process's (a variable the imports set
        may be there with the value they set)."""
        args = request.argv[1:]
        command = cli.command_in(args)
        if command not in cli.POD_COMMANDS:
            return f"{command} is not a pod command"
        env = dict(request.env)
        env["TF_CPP_MIN_LOG_LEVEL"] = cli.native_min_log_level(cli.log_level_in(args), env)
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
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT):
            signal.signal(number, signal.SIG_DFL)
        for number in (signal.SIGPIPE, signal.SIGXFSZ):  # as the interpreter sets them when it starts
            signal.signal(number, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request.env)
        os.environ.update(self.set_by_imports)
        os.chdir(request.cwd)
        sys.argv = list(request.argv)
        sys.path[0] = os.path.dirname(request.argv[0])
        import numpy

        numpy.random.seed()
        cli.run_forked_pod(request.argv[1:])
