"""Blocking TCP with deadlines: the reads, writes and listeners of edl-argo's own socket protocols (the
AllreduceStrategy collective, :mod:`edl_argo.collective.transport`, and a parameter server's tensor port,
:mod:`edl_argo.rpc.tensor_port`).

Every read and write takes a *deadline* (``time.monotonic()`` seconds; None: none) and raises
``TimeoutError`` once it has passed, so that no peer holds a thread longer than its caller allows.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from edl_argo.log import get_logger

log = get_logger(__name__)

#: The most buffers one ``sendmsg`` call takes (Linux's IOV_MAX is 1024).
_SENDMSG_BUFFERS = 512


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (None: no deadline); raises TimeoutError once it has passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None) -> int:
    """Fill ``view`` from ``sock``; the bytes read, which is less than ``len(view)`` only when the peer closed
    the connection before sending the first byte (ConnectionError when it closed it later)."""
    # Without a deadline (a blocking socket), MSG_WAITALL lets the kernel fill the whole view in one call,
    # without taking the GIL back for every segment; with one, each call may wait only what is left.
    flags = socket.MSG_WAITALL if deadline is None else 0
    received = 0
    while received < len(view):
        if deadline is not None:
            sock.settimeout(remaining(deadline))
        got = sock.recv_into(view[received:], 0, flags)
        if not got:
            if received == 0:
                return 0
            raise ConnectionError(f"connection closed after {received} of {len(view)} bytes")
        received += got
    return received


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None, what: str) -> None:
    """Fill ``view`` from ``sock``; ConnectionError naming ``what`` if the peer closes first."""
    if len(view) and recv_exact_into(sock, view, deadline) == 0:
        raise ConnectionError(f"connection closed before {what} ({len(view)} bytes)")


def send_parts(sock: socket.socket, parts: Sequence[bytes | memoryview], deadline: float | None) -> None:
    """Send every part in order, all of it before ``deadline`` (TimeoutError otherwise): many parts per
    system call (``sendmsg``), each sent from its own memory."""
    pending = [memoryview(part).cast("B") for part in parts if len(part)]
    if isinstance(sock, ssl.SSLSocket):  # which has no sendmsg
        for part in pending:
            sock.settimeout(remaining(deadline))
            sock.sendall(part)
        return
    while pending:
        sock.settimeout(remaining(deadline))
        sent = sock.sendmsg(pending[:_SENDMSG_BUFFERS])
        while sent:
            if sent >= len(pending[0]):
                sent -= len(pending.pop(0))
            else:
                pending[0] = pending[0][sent:]
                sent = 0


def connect(target: tuple[str, int], deadline: float) -> socket.socket:
    """A TCP connection to ``target`` (``(host, port)``) with Nagle's delay off, opened before
    ``deadline``."""
    sock = socket.create_connection(target, timeout=remaining(deadline))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def open_listener(host: str, port: int) -> socket.socket | None:
    """A listening socket on ``host:port`` (port 0: any free one); None if ``port`` is taken.

    SO_REUSEADDR (a restarted server may rebind a port whose old connections linger) but never SO_REUSEPORT:
    two processes must not share a port and split its connections.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host, port), family=family, reuse_port=False)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            return None
        raise


#: How often an accept loop looks whether its server is stopping.
ACCEPT_POLL_SECONDS = 0.5
#: How long :meth:`SocketServer.stop` waits for each of its threads.
STOP_JOIN_SECONDS = 2.0


@dataclass
class _Connection:
    """A connection a :class:`SocketServer` serves: its thread, and when it was last active."""

    thread: threading.Thread
    last_active: float


def peer_host(peer: str) -> str:
    """The host part of a :class:`SocketServer` peer (``host:port``; an IPv6 host without brackets)."""
    return peer.rsplit(":", 1)[0]


class SocketServer:
    """Serves every connection ``listener`` accepts on a thread of its own, ``serve(sock, peer)``, until
    :meth:`stop`; ``peer`` is ``host:port``. ``serve`` returns when the peer closes the connection or its
    socket is shut down; the server then closes it.

    Bounds: at most ``max_connections`` open at once; one more closes the connection idle longest
    (:meth:`touch` marks one active), logged ``<name>_connection_evicted``. ``name`` prefixes the threads'
    names and the log events. ``wrap``: what a connection is served as (a TLS socket after its handshake),
    on its thread; an ``OSError`` there closes it (logged ``<name>_handshake_failed``, at debug level).
    """

    def __init__(
        self,
        listener: socket.socket,
        serve: Callable[[socket.socket, str], None],
        name: str,
        max_connections: int,
        wrap: Callable[[socket.socket], socket.socket] | None = None,
    ) -> None:
        self._listener = listener
        self._serve = serve
        self._wrap = wrap
        self._name = name
        self.max_connections = max_connections
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, _Connection] = {}
        self.port: int = listener.getsockname()[1]
        listener.settimeout(ACCEPT_POLL_SECONDS)
        self._acceptor = threading.Thread(target=self._accept, name=f"{name}-accept-{self.port}", daemon=True)
        self._acceptor.start()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, address = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as error:
                if self._stopping.is_set():
                    return
                log.warning(f"{self._name}_accept_failed", port=self.port, error=str(error))
                time.sleep(ACCEPT_POLL_SECONDS)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = f"{address[0]}:{address[1]}"
            thread = threading.Thread(
                target=self._run, args=(sock, peer), name=f"{self._name}-read-{peer}", daemon=True
            )
            with self._lock:
                if self._stopping.is_set():
                    sock.close()
                    return
                evicted = self._evict_idlest_locked(peer)
                self._connections[sock] = _Connection(thread, time.monotonic())
            if evicted is not None:
                with contextlib.suppress(OSError):  # its thread closes it
                    evicted.shutdown(socket.SHUT_RDWR)
            thread.start()

    def _evict_idlest_locked(self, newcomer: str) -> socket.socket | None:
        """With ``max_connections`` open, the connection idle longest (to be closed)."""
        if len(self._connections) < self.max_connections:
            return None
        sock = min(self._connections, key=lambda s: self._connections[s].last_active)
        idle = time.monotonic() - self._connections.pop(sock).last_active  # its thread ends on its own
        log.warning(
            f"{self._name}_connection_evicted", port=self.port, newcomer=newcomer, idle_seconds=round(idle, 1)
        )
        return sock

    def _run(self, sock: socket.socket, peer: str) -> None:
        try:
            if self._wrap is not None:
                try:
                    wrapped = self._wrap(sock)  # the socket's file descriptor moves to the wrapper
                except OSError as error:
                    log.debug(f"{self._name}_handshake_failed", peer=peer, error=str(error))
                    return
                with self._lock:
                    connection = self._connections.pop(sock, None)
                    if connection is not None:
                        self._connections[wrapped] = connection
                sock = wrapped
            self._serve(sock, peer)
        finally:
            with self._lock:
                self._connections.pop(sock, None)
            sock.close()

    def touch(self, sock: socket.socket) -> None:
        """Mark ``sock``'s connection active now."""
        connection = self._connections.get(sock)
        if connection is not None:
            connection.last_active = time.monotonic()

    def stop_accepting(self) -> None:
        """Accept no more connections (the open ones are served on); :meth:`stopping` is true from now."""
        with self._lock:
            self._stopping.set()
        with contextlib.suppress(OSError):  # wakes the accept thread at once (Linux); the poll otherwise
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def stop(self) -> None:
        """Stop accepting, shut every connection down, and join the threads."""
        self.stop_accepting()
        with self._lock:
            connections = dict(self._connections)
        for sock in connections:
            with contextlib.suppress(OSError):  # already closed by its thread
                sock.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(STOP_JOIN_SECONDS + ACCEPT_POLL_SECONDS)
        for connection in connections.values():
            connection.thread.join(STOP_JOIN_SECONDS)
