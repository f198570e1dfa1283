"""``host:port`` addresses, IPv6 included: an IPv6 host is written in brackets (``[::1]:2222``), as gRPC,
URLs and ``socket`` users expect; every address edl-argo builds goes through :func:`join_host_port`."""

from __future__ import annotations


def join_host_port(host: str, port: int | str) -> str:
    """``host:port``, with an IPv6 ``host`` in brackets (``[fd00::5]:2222``); a bracketed host stays so."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` (an IPv6 host in brackets or not); the host without brackets."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
