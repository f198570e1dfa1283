"""Port allocation for pods that listen (parameter servers)."""

from __future__ import annotations

import socket
import threading

_MAX_ATTEMPTS = 100
_lock = threading.Lock()
_handed_out: set[tuple[str, int]] = set()


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now, for a PS to bind.

    The port is found by binding port 0 and closing the socket, so another program may still take it
    before the PS binds it (rare: the kernel hands out ephemeral ports in a spread-out order). Within
    this process the same ``(host, port)`` is never returned twice, so PSes started by one master
    do not collide with each other.

    Raises:
        OSError: ``host`` is not an address of this machine, or no new port was found.
    """
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    for _ in range(_MAX_ATTEMPTS):
        with socket.socket(family, kind, proto) as sock:
            sock.bind(sockaddr)
            port: int = sock.getsockname()[1]
        with _lock:
            if (host, port) not in _handed_out:
                _handed_out.add((host, port))
                return port
    raise OSError(f"no unused TCP port found on {host} after {_MAX_ATTEMPTS} attempts")
