"""Stand-in containers forked from a pod template instead of started with ``exec``: test speed only.

An ``edl-argo worker`` or ``edl-argo ps`` container started with ``exec`` spends 4.5-6 s of a core importing
TensorFlow, and the Kubernetes tests start dozens. The stand-in forks such containers from the product's
pod template (:class:`edl_argo.pods.prefork.PodTemplate`, the local backend's), one per test process,
started in the background the first time a container could use it; until it is ready, containers start
with ``exec`` as before, and so does every other command. A forked container is the same as an exec'd one
to the stand-in: a process group of its own (the template's supervisor leads it), one output stream of its
stdout and stderr in the order written (a FIFO both write to), and a Popen-like exit status.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from edl_argo.pods.prefork import ForkRequest, PodTemplate, template_program
from edl_argo.pods.supervisor import EXIT_FILE

#: ``0`` in the test process's environment: every container starts with ``exec``.
FORK_ENV = "EDL_TEST_STAND_IN_FORK"

_lock = threading.Lock()
_template: PodTemplate | None = None


def shared_template(environment: Mapping[str, str]) -> PodTemplate:
    """This test process's template, started in the background on the first call with ``environment``
    (the containers' environment before their own variables)."""
    global _template
    with _lock:
        if _template is None:
            base = dict(environment)
            _template = PodTemplate(f"k8s-stand-in-{os.getpid()}", lambda: dict(base))
            _template.start_in_background()
        return _template


class ForkedProcess:
    """A forked container's process group, as the stand-in uses a :class:`subprocess.Popen`."""

    def __init__(self, pid: int, stdout: IO[bytes], exit_pipe: int, folder: Path) -> None:
        self.pid = pid
        self.stdout = stdout
        self._exit_pipe = exit_pipe
        self._folder = folder
        self._lock = threading.Lock()
        self._returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        """The command's exit status once the supervisor ended (``-N``: killed by signal N, as Popen's;
        a supervisor killed with its command wrote none: SIGKILL); :class:`subprocess.TimeoutExpired` if it
        has not ended within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        def expired() -> subprocess.TimeoutExpired:
            return subprocess.TimeoutExpired(f"pod process group {self.pid}", timeout or 0.0)

        # another thread may be waiting (the stand-in watches every container): wait for it, in bounds
        bound = left()
        if not self._lock.acquire(timeout=-1.0 if bound is None else bound):
            raise expired()
        try:
            if self._returncode is None:
                with contextlib.suppress(OSError):
                    while True:
                        if not select.select([self._exit_pipe], [], [], left())[0]:
                            raise expired()
                        if not os.read(self._exit_pipe, 64):
                            break
                os.close(self._exit_pipe)
                try:
                    self._returncode = int((self._folder / EXIT_FILE).read_text())
                except (OSError, ValueError):
                    self._returncode = -signal.SIGKILL
            return self._returncode
        finally:
            self._lock.release()


def start_forked(
    argv: Sequence[str], env: Mapping[str, str], cwd: Path, folder: Path, base_env: Mapping[str, str]
) -> ForkedProcess | None:
    """``argv`` forked from this process's template (started now, with ``base_env``, if it is not), or None:
    start it with ``exec`` (not a pod command, the template not ready yet or declining, or forking off)."""
    if os.environ.get(FORK_ENV, "1") == "0" or argv[0] != template_program():
        return None
    return fork_container(shared_template(base_env), argv, env, cwd, folder)


def fork_container(
    template: PodTemplate, argv: Sequence[str], env: Mapping[str, str], cwd: Path, folder: Path
) -> ForkedProcess | None:
    """Start ``argv`` forked from ``template`` with its output readable as one stream; None when the
    template is not ready or declines (start it with ``exec``)."""
    if not (template.ready and template.serves(argv[0])):
        return None
    folder.mkdir(parents=True)
    output = folder / "stdout"
    os.mkfifo(output)
    (folder / "stderr").symlink_to("stdout")
    reader = os.open(output, os.O_RDONLY | os.O_NONBLOCK)
    keeper = os.open(output, os.O_WRONLY)  # no end-of-file before the supervisor opened its end
    try:
        forked = template.fork(ForkRequest(tuple(argv), dict(env), str(cwd), str(folder)))
    finally:
        os.close(keeper)
    if forked is None:
        os.close(reader)
        return None
    os.set_blocking(reader, True)
    return ForkedProcess(forked.pid, os.fdopen(reader, "rb"), forked.exit_pipe, folder)
