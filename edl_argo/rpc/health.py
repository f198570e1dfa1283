"""A liveness check every edl-argo server answers: ``/edl_argo.Health/Ping``, empty request and reply.

It needs no protocol buffer (raw bytes through gRPC's generic handlers), is answered by the server's own
threads (a parameter server's priority pool, :mod:`edl_argo.ps.serving`), and so tells a peer that serves
(it answers, at once) from one that stopped answering (a paused process, a silent network path: the call
runs out of its deadline) or is not there (refused).
"""

from __future__ import annotations

import grpc

_SERVICE = "edl_argo.Health"
#: The ping's full method name (a server may serve it from its priority pool).
PING_METHOD = f"/{_SERVICE}/Ping"


def _identity(data: bytes) -> bytes:
    return data


def add_health_service(server: grpc.Server) -> None:
    """Answer pings on ``server``."""
    handler = grpc.unary_unary_rpc_method_handler(
        lambda _request, _context: b"", request_deserializer=_identity, response_serializer=_identity
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {"Ping": handler}),))


def ping(channel: grpc.Channel, timeout: float) -> None:
    """Ping the server behind ``channel``; raises :class:`grpc.RpcError` unless it answers within
    ``timeout`` seconds (DEADLINE_EXCEEDED: it did not answer; UNAVAILABLE: no connection)."""
    call = channel.unary_unary(PING_METHOD, request_serializer=_identity, response_deserializer=_identity)
    call(b"", timeout=timeout)
