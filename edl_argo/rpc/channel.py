"""Channels and servers with the project's message limits, and calls that ride out a peer's absence."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent import futures
from typing import NoReturn, TypeVar

import grpc

from edl_argo.log import get_logger

log = get_logger(__name__)

#: Largest message a server accepts or a client sends (a dense model partition or a gradient push).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

Response = TypeVar("Response")


def make_channel(address: str) -> grpc.Channel:
    """An insecure channel to ``host:port`` (traffic stays inside the job's network)."""
    return grpc.insecure_channel(address, options=_OPTIONS)


#: Servers never share a port: gRPC's default SO_REUSEPORT would let a second process bind a port in use
#: (pods sharing a host, a leftover process) and split the connections between the two.
_SERVER_OPTIONS = [*_OPTIONS, ("grpc.so_reuseport", 0)]


def make_server(max_workers: int = 8) -> grpc.Server:
    """A server with the same message limits as :func:`make_channel`, owning its port alone."""
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_SERVER_OPTIONS)


def reject_request(context: grpc.ServicerContext, rpc: str, code: grpc.StatusCode, reason: str) -> NoReturn:
    """End the request being served with ``code`` and the one-line ``reason`` (logged as
    ``request_rejected``); the server goes on serving other requests."""
    log.warning("request_rejected", rpc=rpc, code=code.name, reason=reason)
    context.abort(code, reason)
    raise AssertionError("unreachable: context.abort raises")


def call_with_retry(
    call: Callable[[], Response],
    peer: str,
    budget_seconds: float,
    first_delay: float = 0.1,
    max_delay: float = 2.0,
) -> Response:
    """Run ``call`` until it succeeds, retrying while the peer is unavailable for up to ``budget_seconds``.

    Only UNAVAILABLE and DEADLINE_EXCEEDED are retried (a restarting master or PS); any other status is
    raised at once. The last error is raised when the budget is spent.
    """
    deadline = time.monotonic() + budget_seconds
    delay = first_delay
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except grpc.RpcError as error:
            code = error.code() if hasattr(error, "code") else None
            if code not in _RETRYABLE or time.monotonic() + delay > deadline:
                raise
            if attempt == 1 or attempt % 10 == 0:
                log.warning("peer_unavailable", peer=peer, attempt=attempt, retry_in=round(delay, 2))
            time.sleep(delay * (0.5 + random.random()))
            delay = min(max_delay, delay * 2)
