"""Port allocation for pods that listen (parameter servers, collective members on a shared host).

A port is chosen by number before the pod that listens on it starts, so two masters on one machine (the jobs
of a pipeline's parallel steps, or of parallel tests) could choose the same one between the choice and the
bind. Each chosen port is therefore also *claimed* machine-wide, with an exclusive ``flock`` on a file named
after it (``<temporary folder>/edl-argo-ports-<uid>/``), held until :func:`release_ports` or the end of the
process: a port another process claims is never chosen. The files are never removed (removing a locked file
lets two processes lock two different files of one name).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

_MAX_ATTEMPTS = 200
_lock = threading.Lock()
#: The ports this process chose, with the descriptor of each one's claim (None: none could be made).
_handed_out: dict[tuple[str, int], int | None] = {}

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


def _candidate_ports(highest: int = 65535) -> list[int]:
    """Ports up to ``highest`` outside the ephemeral range in random order, or (when that range leaves no
    room) inside it."""
    low, high = _ephemeral_range()
    ports = [p for p in range(_LOWEST_PORT, highest + 1) if not low <= p <= high]
    if len(ports) < _MAX_ATTEMPTS:
        ports = list(range(low, min(high, highest) + 1))
    return random.sample(ports, min(_MAX_ATTEMPTS, len(ports)))


def _bindable(host: str, port: int) -> bool:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        try:
            sock.bind(sockaddr)
        except OSError:
            return False
    return True


class _Claimed(Exception):
    """The port is claimed by another process."""


def _claim(host: str, port: int) -> int | None:
    """The descriptor holding this process's claim on ``host:port``; None when claims cannot be made here
    (an unwritable temporary folder: the bind check alone then guards the choice). Raises
    :class:`_Claimed` when another process holds it."""
    try:
        folder = Path(tempfile.gettempdir()) / f"edl-argo-ports-{os.getuid()}"  # this user's claims
        folder.mkdir(mode=0o700, exist_ok=True)
        descriptor = os.open(folder / f"{host}-{port}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        raise _Claimed from None
    return descriptor


def find_free_port(host: str = "127.0.0.1", highest: int = 65535) -> int:
    """A TCP port on ``host`` that nothing listens on now, for a PS to bind later, claimed machine-wide
    until :func:`release_ports` (see the module docstring).

    The port is chosen outside the kernel's ephemeral range, so the outgoing connections of this
    machine (which draw their local ports from that range) cannot take it between this call and the
    PS binding it; no other master on this machine chooses it while it is claimed; only a program binding
    that very port by number could take it. Within this process the same ``(host, port)`` is never
    returned twice before it is released. ``highest``: the highest port that may be chosen (a Kubernetes
    PS's port leaves room for its tensor port above it:
    :func:`~edl_argo.pods.kubernetes_config.highest_ps_port`).

    Raises:
        OSError: ``host`` is not an address of this machine, or no free port was found.
    """
    socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)  # an unknown host fails here, clearly
    for port in _candidate_ports(highest):
        with _lock:
            if (host, port) in _handed_out:
                continue
            try:
                claim = _claim(host, port)
            except _Claimed:
                continue
            if not _bindable(host, port):
                if claim is not None:
                    os.close(claim)
                continue
            _handed_out[(host, port)] = claim
            return port
    raise OSError(f"no unused TCP port found on {host} after {_MAX_ATTEMPTS} attempts")


def release_ports(host: str, ports: Iterable[int]) -> None:
    """Give up this process's claims on ``host``'s ``ports`` (those :func:`find_free_port` returned; others
    are ignored): once their pods are gone, other masters may choose them again."""
    with _lock:
        for port in ports:
            claim = _handed_out.pop((host, port), None)
            if claim is not None:
                with contextlib.suppress(OSError):
                    os.close(claim)
