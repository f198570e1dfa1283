"""Port allocation for pods that listen (parameter servers, collective members on a shared host)."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_MAX_ATTEMPTS = 200
_lock = threading.Lock()
_handed_out: set[tuple[str, int]] = set()

#: Where Linux keeps the range it draws outgoing connections' local ports from.
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Lowest port handed out: above the registered ports most local services use.
_LOWEST_PORT = 10000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _candidate_ports() -> list[int]:
    """Ports outside the ephemeral range in random order, or (when that range leaves no room) inside it."""
    low, high = _ephemeral_range()
    ports = [p for p in range(_LOWEST_PORT, 65536) if not low <= p <= high]
    if len(ports) < _MAX_ATTEMPTS:
        ports = list(range(low, high + 1))
    return random.sample(ports, _MAX_ATTEMPTS)


def _bindable(host: str, port: int) -> bool:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        try:
            sock.bind(sockaddr)
        except OSError:
            return False
    return True


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now, for a PS to bind later.

    The port is chosen outside the kernel's ephemeral range, so the outgoing connections of this
    machine (which draw their local ports from that range) cannot take it between this call and the
    PS binding it; only a program binding that very port by number could. Within this process the same
    ``(host, port)`` is never returned twice, so servers started by one master do not collide.

    Raises:
        OSError: ``host`` is not an address of this machine, or no free port was found.
    """
    socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)  # an unknown host fails here, clearly
    for port in _candidate_ports():
        with _lock:
            if (host, port) in _handed_out or not _bindable(host, port):
                continue
            _handed_out.add((host, port))
            return port
    raise OSError(f"no unused TCP port found on {host} after {_MAX_ATTEMPTS} attempts")
