"""Channels and servers with the project's message limits, and calls that ride out a peer's absence.

No call waits without a bound: every call made through :func:`call_with_retry` has a deadline
(``--rpc-timeout-seconds``, default :data:`RPC_TIMEOUT_SECONDS`), so a peer that stops answering (SIGSTOP,
a network path that drops packets without a reset) costs at most that long per attempt. Channels and
servers send HTTP/2 keepalive pings (every :data:`KEEPALIVE_TIME_MS` without traffic, including between
calls) and drop a connection whose ping is not answered within :data:`KEEPALIVE_TIMEOUT_MS`, so a silent
peer is noticed within their sum even when no call is running, and the next call reconnects.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import NoReturn, TypeVar

import grpc

from edl_argo.log import get_logger
from edl_argo.rpc.auth import ClientCredential, authenticated, credential_from_env
from edl_argo.rpc.server_limits import ServerLimits
from edl_argo.rpc.tls import TlsFiles
from edl_argo.rpc.tls import channel as tls_channel
from edl_argo.settings import table

log = get_logger(__name__)

#: Largest message a server accepts or a client sends (a dense model partition or a gradient push).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
#: Default deadline of one gRPC call, in seconds (``--rpc-timeout-seconds``).
RPC_TIMEOUT_SECONDS = table.RPC_TIMEOUT_SECONDS
#: Keepalive: a ping after this long without traffic, and the connection is dropped when its answer takes
#: longer than :data:`KEEPALIVE_TIMEOUT_MS`.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
#: A connection attempt that gets no answer is given up after this long (gRPC's default: 20 s).
RECONNECT_MS = 5_000
#: Connection attempts to a peer that refuses them are at most this far apart, so that a peer back at its
#: address (a restarted master or PS) is used within a second. gRPC's default cap, 120 s, would leave it
#: unused for minutes; at 5 s, a member of an AllreduceStrategy group rejoined a restarted master up to 5 s
#: after its peer, which trained alone meanwhile. An attempt is one connection the peer's kernel refuses.
RECONNECT_BACKOFF_MS = 1_000
_CHANNEL_OPTIONS = [
    *_OPTIONS,
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Any ping (keepalive or gRPC's own bandwidth probes) unanswered this long drops the connection; the
    # default, 60 s, held keepalive back while a probe sent just before the peer went silent was pending.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # gRPC reads its "min reconnect backoff" as the connection attempt's timeout.
    ("grpc.min_reconnect_backoff_ms", RECONNECT_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
]

Response = TypeVar("Response")
#: The most of a failed call's details a ``peer_unavailable`` line quotes.
REASON_CHARS = 300


def make_channel(
    address: str,
    credential: ClientCredential | None = None,
    tls: TlsFiles | None = None,
    *,
    own_connection: bool = False,
) -> grpc.Channel:
    """A channel to ``host:port`` with keepalive whose calls present ``credential`` (default: this
    process's, :func:`~edl_argo.rpc.auth.credential_from_env`; none if it has none). With ``tls``
    (:mod:`edl_argo.rpc.tls`) the connection is TLS and the server's certificate is checked; without, plain
    TCP: the credential authenticates, it does not encrypt. gRPC lets the channels of a process to the same
    address share one connection; ``own_connection``: this one has a connection of its own (the simulated
    workers of a load test, many in a process, connect as separate pods would)."""
    options = [*_CHANNEL_OPTIONS, *([("grpc.use_local_subchannel_pool", 1)] if own_connection else [])]
    if tls is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = tls_channel(address, tls, options)
    return authenticated(channel, credential if credential is not None else credential_from_env())


#: Servers never share a port: gRPC's default SO_REUSEPORT would let a second process bind a port in use
#: (pods sharing a host, a leftover process) and split the connections between the two. They ping their
#: clients as clients ping them, and accept the clients' pings at that rate.
_SERVER_OPTIONS = [
    *_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]


def make_server(
    max_workers: int = 8,
    *,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    maximum_concurrent_rpcs: int | None = None,
    limits: ServerLimits | None = None,
) -> grpc.Server:
    """A server with the same message limits as :func:`make_channel`, owning its port alone.

    ``maximum_concurrent_rpcs``: calls beyond this many running or queued are refused at once with
    ``RESOURCE_EXHAUSTED`` (None: no bound). ``limits`` (:mod:`edl_argo.rpc.server_limits`) instead: its
    ``threads`` instead of ``max_workers``, a pool of its own for its priority methods, a cap on concurrent
    calls, a bound on every call's life and on its request's arrival, and its own decoding of requests
    (``interceptors``, e.g. authentication, run inside the priority pool and before the decoding)."""
    if limits is not None:
        return grpc.server(
            futures.ThreadPoolExecutor(max_workers=limits.threads),
            options=[*_SERVER_OPTIONS, *limits.options()],
            interceptors=limits.interceptors(interceptors),
            maximum_concurrent_rpcs=limits.max_concurrent_calls,
        )
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=_SERVER_OPTIONS,
        interceptors=interceptors,
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
    )


def reject_request(context: grpc.ServicerContext, rpc: str, code: grpc.StatusCode, reason: str) -> NoReturn:
    """End the request being served with ``code`` and the one-line ``reason`` (logged as
    ``request_rejected``); the server goes on serving other requests."""
    log.warning("request_rejected", rpc=rpc, code=code.name, reason=reason)
    context.abort(code, reason)
    raise AssertionError("unreachable: context.abort raises")


def call_with_retry(
    call: Callable[[float], Response],
    peer: str,
    budget_seconds: float,
    timeout_seconds: float = RPC_TIMEOUT_SECONDS,
    first_delay: float = 0.1,
    max_delay: float = 2.0,
) -> Response:
    """Run ``call(timeout)`` until it succeeds, retrying while the peer is unavailable for up to
    ``budget_seconds``.

    Each attempt gets the deadline ``timeout`` = ``timeout_seconds``, or what is left of the budget if less.
    Only UNAVAILABLE and DEADLINE_EXCEEDED are retried (a restarting or hung master or PS); any other status
    is raised at once. The last error is raised when the budget is spent.
    """
    deadline = time.monotonic() + budget_seconds
    delay = first_delay
    attempt = 0
    while True:
        attempt += 1
        try:
            return call(max(0.1, min(timeout_seconds, deadline - time.monotonic())))
        except grpc.RpcError as error:
            code = error.code() if hasattr(error, "code") else None
            if code not in _RETRYABLE or time.monotonic() + delay > deadline:
                raise
            if attempt == 1 or attempt % 10 == 0:
                log.warning(
                    "peer_unavailable",
                    peer=peer,
                    attempt=attempt,
                    code=code.name,
                    retry_in=round(delay, 2),
                    # Why: connection refused, a TLS handshake that failed (CERTIFICATE_VERIFY_FAILED), ...
                    reason=(error.details() or "")[:REASON_CHARS] if hasattr(error, "details") else "",
                )
            time.sleep(delay * (0.5 + random.random()))
            delay = min(max_delay, delay * 2)
