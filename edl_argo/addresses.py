"""``host:port`` addresses, IPv6 included: an IPv6 host is written in brackets (``[::1]:2222``), as gRPC,
URLs and ``socket`` users expect; every address edl-argo builds goes through :func:`join_host_port`."""

from __future__ import annotations

import ipaddress
import re


def join_host_port(host: str, port: int | str) -> str:
    """``host:port``, with an IPv6 ``host`` in brackets (``[fd00::5]:2222``); a bracketed host stays so."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` (an IPv6 host in brackets or not); the host without brackets."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


#: Longest address :func:`parse_host_port` accepts: a DNS name of 253 characters, ``:`` and a port.
MAX_ADDRESS_CHARS = 253 + 1 + 5
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


class AddressError(ValueError):
    """An address that is not ``host:port`` with a valid host and a port in 1-65535."""


def parse_host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``address``, checked: a DNS name or IPv4 address, or an IPv6 address in brackets,
    then ``:`` and a port in 1-65535; at most :data:`MAX_ADDRESS_CHARS` characters. Raises
    :class:`AddressError` naming what is wrong (the address itself shortened to 80 characters)."""
    shown = repr(address[:80]) + ("..." if len(address) > 80 else "")
    if len(address) > MAX_ADDRESS_CHARS:
        raise AddressError(f"address {shown} is {len(address)} characters, more than {MAX_ADDRESS_CHARS}")
    host, colon, port = address.rpartition(":")
    if not colon or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise AddressError(f"address {shown}: host:port with a port in 1-65535 expected")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise AddressError(f"address {shown}: {host} is not an IPv6 address") from None
        return host[1:-1], int(port)
    labels = host.split(".")
    if not host or len(host) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise AddressError(f"address {shown}: the host is not a DNS name, an IPv4 address or [IPv6]")
    return host, int(port)
