"""The supervisor of a local pod: the first process of its group, which runs the pod's command and records
how it ended (:mod:`edl_argo.pods.local` describes the pod's folder).

It writes ``supervisor`` (its pid, which is the group's id, and its start time in clock ticks since boot),
forks the command, ignores SIGTERM, SIGINT and SIGHUP itself (they reach the command directly, as a member
of the group), waits for the command, writes its exit status to ``exit`` (``-N``: killed by signal N) and
exits with it (``128 + N`` for a signal).

Two ways to become one, one logic (:func:`supervise`):

* **exec**: ``python -I -S supervisor.py <pod folder> <program> <args>...``, started by the backend in a new
  session with the output files on descriptors 1 and 2; the command is ``execv``'d. Only the standard
  library, no site packages: it starts in milliseconds.
* **fork**: a process forked from the pod template (:mod:`edl_argo.pods.prefork`) sets up the session and
  descriptors itself, then calls :func:`supervise` with a command that runs in the forked child.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

SUPERVISOR_FILE, EXIT_FILE = "supervisor", "exit"


def write_file(folder: str, name: str, text: str) -> None:
    """Replace ``folder/name`` by ``text`` atomically; a folder that is gone is not an error."""
    try:
        temporary = os.path.join(folder, "." + name + ".tmp")
        with open(temporary, "w") as file:
            file.write(text)
        os.replace(temporary, os.path.join(folder, name))
    except OSError:
        pass


def own_start_ticks() -> str:
    """This process's start time in clock ticks since boot (``/proc/self/stat``), ``""`` if unknown."""
    try:
        with open("/proc/self/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def supervise(
    folder: str, run_command: Callable[[], object], close_in_command: Sequence[int] = ()
) -> NoReturn:
    """Be the supervisor of the pod whose folder is ``folder``: the command is ``run_command()`` in a
    forked child (which closes ``close_in_command`` first; if ``run_command`` returns, the child exits 127).
    Never returns: exits with the command's status."""
    record = {"pid": os.getpid(), "pgid": os.getpgid(0), "start_ticks": own_start_ticks()}
    write_file(folder, SUPERVISOR_FILE, json.dumps(record))
    child = os.fork()
    if child == 0:
        try:
            for descriptor in close_in_command:
                os.close(descriptor)
            run_command()
        finally:
            os._exit(127)
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, lambda *_: None)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    write_file(folder, EXIT_FILE, str(code))
    os._exit(code if code >= 0 else 128 - code)


def exec_command(argv: Sequence[str]) -> NoReturn:
    """Replace this process by ``argv`` with SIGPIPE and SIGXFSZ back to their defaults (this interpreter
    ignores them, and an ignored signal stays ignored across ``execv``); exit 127 if it cannot run."""
    for number in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(number, signal.SIG_DFL)
    try:
        os.execv(argv[0], list(argv))
    except OSError as error:
        sys.stderr.write(f"cannot start {argv[0]}: {error}\n")
        sys.stderr.flush()
    os._exit(127)


if __name__ == "__main__":
    supervise(sys.argv[1], lambda: exec_command(sys.argv[2:]))
