"""The warm server's loop: connections, the commands and pods it forks, their exits, its idle end.

:mod:`edl_argo.pods.warm` states what a server promises its clients; :func:`edl_argo.zygote.main_warm`
imports everything, binds the socket and calls :func:`serve_warm`. A connection carries, in any order:

- ``{"run": argv, "env", "cwd", "umask"}`` with the client's descriptors 0, 1 and 2: fork the command
  (:class:`~edl_argo.pods.warm.CommandRequest`), answer ``{"pid": pid}`` (or ``{"exec": reason}``), and
  when it exits, ``{"exit": status}``, then close the connection. If the client closes it first, the
  command gets SIGTERM, and its session SIGKILL :data:`~edl_argo.pods.warm.ORPHAN_GRACE_SECONDS` later.
- a pod request of a pod template (:class:`~edl_argo.pods.prefork.ForkRequest` and its exit pipe),
  answered as a template answers (:func:`~edl_argo.pods.prefork.start_pod`): a master's pods.
- ``{"check": true, "run": ...}`` (no descriptors): answer ``{}`` if it would run that command, else
  ``{"exec": reason}`` (``edl-argo warm`` asks before it says a server runs).
- ``{"stop": true}``: answer, remove the socket and exit (what it forked runs on).
- ``{"retire": true}``: remove the socket, take no new connection and answer; exit once no connection is
  open and no command runs (what a pipeline run asks of the server it started: a command of another
  client that found it meanwhile ends as it would have).

It forks only while it runs no thread besides its own (as a template), and exits once no connection is
open and no command runs for ``idle_seconds``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn, Protocol

from edl_argo.log import get_logger
from edl_argo.pods.prefork import ForkRequest, fork_unless, peer_uid, start_pod
from edl_argo.pods.warm import ORPHAN_GRACE_SECONDS, CommandRequest

log = get_logger(__name__)

_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_WAKE_SECONDS = 1.0
"""How often the loop wakes with nothing to read (to reap and to check for idleness)."""


class Forks(Protocol):
    """What the server does with a request (:class:`edl_argo.zygote.Template`)."""

    def decline(self, request: ForkRequest) -> str | None:
        """Why a pod must be started with exec, or None."""

    def run_command(self, request: ForkRequest) -> NoReturn:
        """In a pod's forked command process: become it."""

    def decline_command(self, request: CommandRequest) -> str | None:
        """Why the client must run ``request`` itself, or None."""

    def run_warm_command(self, request: CommandRequest) -> NoReturn:
        """In the forked process of a command (descriptors and session set): become it."""


def serve_warm(listener: socket.socket, path: Path, forks: Forks, idle_seconds: float) -> NoReturn:
    """Serve ``listener`` (bound at ``path``, listening) until stopped or idle (see the module
    docstring). Removes ``path`` as it exits, if it is still this server's socket."""
    _Server(listener, path, forks, idle_seconds).run()


class _Server:
    def __init__(self, listener: socket.socket, path: Path, forks: Forks, idle_seconds: float) -> None:
        self.listener: socket.socket | None = listener
        self.path = path
        self.inode = path.stat().st_ino
        self.forks = forks
        self.idle_seconds = idle_seconds
        self.connections: set[socket.socket] = set()
        self.commands: dict[int, socket.socket | None] = {}
        """Each running command's pid and the connection of its client (None once that closed)."""
        self.orphaned: dict[int, float] = {}
        """When each command whose client closed got SIGTERM (``time.monotonic()``)."""
        self.busy_at = time.monotonic()
        self.wake_read, self.wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda _number, _frame: None)
        signal.set_wakeup_fd(self.wake_write)

    def run(self) -> NoReturn:
        while True:
            self._reap()
            self._kill_late_orphans()
            if self.connections or self.commands:
                self.busy_at = time.monotonic()
            elif time.monotonic() - self.busy_at > self.idle_seconds:
                log.info("warm_server_idle", minutes=round(self.idle_seconds / 60, 2))
                self._exit()
            listening = [] if self.listener is None else [self.listener]
            readable, _, _ = select.select(
                [*listening, self.wake_read, *self.connections], [], [], _WAKE_SECONDS
            )
            if self.wake_read in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_read, 4096)
            if self.listener is not None and self.listener in readable:
                self._accept()
            for channel in readable:
                if channel in self.connections:
                    self._handle(channel)

    # -- connections ------------------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            channel, _ = self.listener.accept()
        except OSError:
            return
        if peer_uid(channel) != os.getuid():
            channel.close()
            return
        self.connections.add(channel)
        self._send(channel, {"ready": os.getpid()})

    def _handle(self, channel: socket.socket) -> None:
        try:
            message, descriptors, _, _ = socket.recv_fds(channel, _MAX_MESSAGE_BYTES, 3)
        except OSError:
            message, descriptors = b"", []
        if not message:
            _close_all(descriptors)
            self._drop(channel)
            return
        try:
            record = json.loads(message)
        except ValueError:
            record = {}
        if not isinstance(record, dict):
            record = {}
        if record.get("stop"):
            _close_all(descriptors)
            self._send(channel, {"stopping": os.getpid()})
            log.info("warm_server_stopped")
            self._exit()
        if record.get("retire"):
            _close_all(descriptors)
            self._retire()  # before the answer: its sender may count on the socket being gone
            self._send(channel, {"retiring": os.getpid()})
            return
        if record.get("check"):
            _close_all(descriptors)
            reply = self._check(record)
        elif "run" in record:
            reply = self._start_command(channel, record, descriptors)
        elif len(descriptors) == 1:
            reply = start_pod(
                message, descriptors[0], self.forks.decline, self.forks.run_command, self._close
            )
        else:
            _close_all(descriptors)
            reply = {"exec": "the request carried neither a command nor a pod's exit pipe"}
        self._send(channel, reply)

    def _send(self, channel: socket.socket, reply: Mapping[str, object]) -> None:
        try:
            channel.send(json.dumps(reply).encode())
        except OSError:
            self._drop(channel)

    def _drop(self, channel: socket.socket) -> None:
        """Close a connection; a command its client started gets SIGTERM (the client is gone)."""
        if channel not in self.connections:
            return
        self.connections.discard(channel)
        channel.close()
        for pid, client in self.commands.items():
            if client is channel:
                self.commands[pid] = None
                self.orphaned[pid] = time.monotonic()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                log.info("warm_command_orphaned", pid=pid, consequence="SIGTERM")

    def _kill_late_orphans(self) -> None:
        for pid, since in list(self.orphaned.items()):
            if time.monotonic() - since > ORPHAN_GRACE_SECONDS:
                del self.orphaned[pid]
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                log.warning("warm_command_killed", pid=pid, after_seconds=ORPHAN_GRACE_SECONDS)

    # -- commands -----------------------------------------------------------------------------------------

    def _check(self, record: dict[str, Any]) -> dict[str, object]:
        """Whether the command of ``record`` would run here: ``{}``, or ``{"exec": reason}``."""
        try:
            reason = self.forks.decline_command(CommandRequest.decode(record))
        except ValueError as error:
            reason = f"an unreadable request: {error}"
        return {} if reason is None else {"exec": reason}

    def _start_command(
        self, channel: socket.socket, record: dict[str, Any], descriptors: list[int]
    ) -> dict[str, object]:
        try:
            if len(descriptors) != 3:
                return {"exec": "the request carried no standard input, output and error"}
            try:
                request = CommandRequest.decode(record)
            except ValueError as error:
                return {"exec": f"an unreadable request: {error}"}

            def command() -> None:
                self._close()
                os.setsid()
                for target, descriptor in enumerate(descriptors):
                    os.dup2(descriptor, target)
                _close_all(descriptors)
                os.umask(request.umask)
                self.forks.run_warm_command(request)

            pid = fork_unless(self.forks.decline_command(request), command)
            if isinstance(pid, str):
                return {"exec": pid}
            self.commands[pid] = channel
            log.info("warm_command_started", command=" ".join(request.argv[1:2]), pid=pid)
            return {"pid": pid}
        finally:
            _close_all(descriptors)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid not in self.commands:
                continue  # a pod's supervisor
            channel = self.commands.pop(pid)
            self.orphaned.pop(pid, None)
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
            log.info("warm_command_ended", pid=pid, exit_code=code)
            if channel is not None:
                self._send(channel, {"exit": code})
                self._drop(channel)

    # -- ending -------------------------------------------------------------------------------------------

    def _close(self) -> None:
        """In a forked child: close what is the server's (its sockets, its wake-up pipe and handler)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if self.listener is not None:
            self.listener.close()
        for channel in self.connections:
            channel.close()
        _close_all([self.wake_read, self.wake_write])

    def _retire(self) -> None:
        """Take no new connection, and exit as soon as nothing is open or running (idle from now on)."""
        self._unlink()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self.idle_seconds = 0.0
        log.info("warm_server_retiring", connections=len(self.connections), commands=len(self.commands))

    def _unlink(self) -> None:
        """Remove the socket's path if it is still this server's (another server may have taken it)."""
        with contextlib.suppress(OSError):
            if self.path.stat().st_ino == self.inode:
                self.path.unlink()

    def _exit(self) -> NoReturn:
        self._unlink()
        sys.stderr.flush()
        os._exit(0)


def _close_all(descriptors: list[int]) -> None:
    for descriptor in descriptors:
        with contextlib.suppress(OSError):
            os.close(descriptor)
