"""TEST-ONLY: a TCP proxy in front of a server that injects network faults for a given number of seconds.

:class:`FaultProxy` listens on 127.0.0.1 and forwards every connection to ``upstream``. With ``tls`` it
terminates TLS itself (a self-signed certificate for 127.0.0.1 from :func:`self_signed_certificate`) and
forwards plain bytes, so a plain-HTTP server is reached over ``https://``. :meth:`FaultProxy.fault` starts one
fault that lasts ``seconds``; connections open when it starts are cut (paused for a stall):

``refuse``
    nothing listens on the port: connections are refused.
``reset``
    connections are accepted and reset at once (TCP RST).
``stall``
    connections are accepted and whatever the client sends is swallowed; nothing ever comes back.
``tls_drop``
    the TLS handshake is cut: the proxy reads the ClientHello and closes the connection (no RST), so the
    client's TLS layer sees an unexpected EOF.
``http_429`` / ``http_503``
    every request is answered ``429 Too Many Requests`` / ``503 Service Unavailable`` with a plain-text
    body, as a load balancer in front of the store would.

After the fault's time, new connections are forwarded again. :meth:`FaultProxy.cut_after` instead cuts one
connection once a number of bytes went back to the client (a reset in the middle of a download): it first
pauses, so that the client reads what was relayed rather than having it cut away in its socket buffer.
:attr:`FaultProxy.bytes_to_client` counts every byte sent back, and :attr:`FaultProxy.range_starts` lists the
first byte of every ranged request (``Range: bytes=N-...``) in the order the requests came.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import ssl
import struct
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType

FAULTS = ("refuse", "reset", "stall", "tls_drop", "http_429", "http_503")
_STATUS_LINES = {"http_429": "429 Too Many Requests", "http_503": "503 Service Unavailable"}
_IO_TIMEOUT = 10.0
_CUT_PAUSE_SECONDS = 1.0  # before a cut_after reset: time for the client to read what was relayed
_RANGE_HEADER = re.compile(rb"(?im)^range:\s*bytes=(\d+)-")


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """``(certificate, key)`` PEM files for 127.0.0.1, made with the ``openssl`` command."""
    cert, key = folder / "proxy-cert.pem", folder / "proxy-key.pem"
    subprocess.run(
        [
            *(
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
            ),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP RST instead of an orderly FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """A fault-injecting TCP (or TLS-terminating) proxy to ``upstream``; see the module docstring."""

    def __init__(self, upstream: tuple[str, int], *, tls: tuple[Path, Path] | None = None) -> None:
        self.upstream = upstream
        self._tls: ssl.SSLContext | None = None
        if tls is not None:
            self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._tls.load_cert_chain(str(tls[0]), str(tls[1]))
        self._lock = threading.Lock()
        self._fault = ""
        self._until = 0.0
        self._epoch = 0  # increases with every fault: connections of an older epoch are cut
        self._stopping = threading.Event()
        self._cut_after: int | None = None
        #: Bytes relayed from the server to the client, over all connections.
        self.bytes_to_client = 0
        self.range_starts: list[int] = []
        self._listener: socket.socket | None = None
        self.port = 0
        self._open_listener()
        self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"{'https' if self._tls else 'http'}://127.0.0.1:{self.port}"

    def fault(self, kind: str, seconds: float) -> None:
        """Inject ``kind`` (one of :data:`FAULTS`) for ``seconds`` from now."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self._fault, self._until = kind, time.monotonic() + seconds
            self._epoch += 1
            if kind == "refuse" and self._listener is not None:
                self._listener.close()
                self._listener = None

    def cut_after(self, count: int) -> None:
        """Reset the first connection that relays ``count`` more bytes to the client, once."""
        with self._lock:
            self._cut_after = count

    def _relayed(self, count: int) -> bool:
        """Count ``count`` bytes sent to the client; True if the connection must be cut now."""
        with self._lock:
            self.bytes_to_client += count
            if self._cut_after is None:
                return False
            self._cut_after -= count
            if self._cut_after > 0:
                return False
            self._cut_after = None
            return True

    def _current(self) -> tuple[str, int]:
        with self._lock:
            if self._fault and time.monotonic() >= self._until:
                self._fault = ""
            return self._fault, self._epoch

    def _open_listener(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            fault, _ = self._current()
            with self._lock:
                listener = self._listener
            if listener is None:
                if fault == "refuse":
                    time.sleep(0.02)
                    continue
                with self._lock:
                    self._open_listener()
                continue
            try:
                readable, _, _ = select.select([listener], [], [], 0.05)
                if not readable:
                    continue
                conn, _ = listener.accept()
            except (OSError, ValueError):
                continue  # closed by fault("refuse") or close()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        fault, epoch = self._current()
        conn.settimeout(_IO_TIMEOUT)
        try:
            if fault == "reset":
                _reset(conn)
                return
            if fault == "stall":
                self._swallow(conn)
                return
            if fault == "tls_drop":
                conn.recv(4096)  # the ClientHello
                conn.close()  # an orderly close mid-handshake: the client sees an unexpected EOF
                return
            client: socket.socket = conn
            if self._tls is not None:
                client = self._tls.wrap_socket(conn, server_side=True)
            if fault in _STATUS_LINES:
                self._answer_status(client, _STATUS_LINES[fault])
                return
            self._forward(client, epoch)
        except (OSError, ssl.SSLError):
            _reset(conn)

    def _swallow(self, conn: socket.socket) -> None:
        """Read and drop what the client sends until the stall is over (or the client gives up)."""
        conn.setblocking(False)
        while not self._stopping.is_set() and self._current()[0] == "stall":
            readable, _, _ = select.select([conn], [], [], 0.05)
            if readable:
                try:
                    if not conn.recv(65536):
                        break
                except OSError:
                    break
        _reset(conn)

    @staticmethod
    def _answer_status(client: socket.socket, status: str) -> None:
        """Read one request (head and body) and answer it with ``status``; close the connection."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = client.recv(65536)
            if not chunk:
                return
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(body) < length:
            chunk = client.recv(65536)
            if not chunk:
                return
            body += chunk
        text = status.encode()
        client.sendall(
            b"HTTP/1.1 " + text + b"\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(text)).encode() + b"\r\n\r\n" + text
        )
        client.close()

    def _forward(self, client: socket.socket, epoch: int) -> None:
        """Relay bytes both ways until either side closes or a fault starts (a stall pauses the relay)."""
        upstream = socket.create_connection(self.upstream, timeout=_IO_TIMEOUT)
        try:
            while not self._stopping.is_set():
                fault, current_epoch = self._current()
                if current_epoch != epoch and fault != "stall":
                    _reset(client)
                    return
                if fault == "stall":
                    time.sleep(0.05)  # neither side hears from the other
                    continue
                pending = isinstance(client, ssl.SSLSocket) and client.pending() > 0
                readable = [client] if pending else select.select([client, upstream], [], [], 0.05)[0]
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is client:
                        with self._lock:
                            self.range_starts.extend(int(m) for m in _RANGE_HEADER.findall(data))
                        upstream.sendall(data)
                        continue
                    client.sendall(data)
                    if self._relayed(len(data)):
                        time.sleep(_CUT_PAUSE_SECONDS)
                        _reset(client)
                        return
        finally:
            with contextlib.suppress(OSError):
                upstream.close()
            with contextlib.suppress(OSError):
                client.close()

    def close(self) -> None:
        self._stopping.set()
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
