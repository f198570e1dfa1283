"""A TCP proxy for tests that can stop forwarding without closing anything: the network path that drops
packets without a reset (a partition, a dead node), which only deadlines and keepalive can detect."""

from __future__ import annotations

import contextlib
import socket
import threading


class SilentProxy:
    """Forwards ``127.0.0.1:port`` to ``target`` (``host:port``) while :attr:`forwarding` is set.

    :meth:`go_silent` makes every connection, open or new, swallow what it receives (connections stay
    open, nothing is answered); :meth:`resume` forwards again on connections opened from then on (bytes
    swallowed on the others are lost, as on a real broken path, so those stay broken). :attr:`upstream_bytes`
    counts the bytes forwarded to ``target``.
    """

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._epoch = 0  # connections of an older epoch than a silence stay silent
        self._silent = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        self.upstream_bytes = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def go_silent(self) -> None:
        with self._lock:
            self._silent = True
            self._epoch += 1

    def resume(self) -> None:
        with self._lock:
            self._silent = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = [self._listener, *self._sockets]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _forwarding(self, epoch: int) -> bool:
        with self._lock:
            return not self._silent and epoch == self._epoch

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    return
                epoch = self._epoch
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                args = (source, sink, epoch, sink is upstream)
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, epoch: int, towards_target: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            if not self._forwarding(epoch):
                continue  # swallowed: the path is silent
            try:
                sink.sendall(data)
            except OSError:
                return
            if towards_target:
                with self._lock:
                    self.upstream_bytes += len(data)
