"""How a parameter server's gRPC server bounds its clients (:mod:`edl_argo.rpc.server_limits`): the calls the
workers' training steps and the master's checks depend on have threads of their own, calls in progress are
capped, and no call outlives its caller's deadline by more than the handlers' slack."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from edl_argo.addresses import join_host_port
from edl_argo.log import get_logger
from edl_argo.proto import ps_pb2
from edl_argo.ps.pushed import PushedGradients
from edl_argo.rpc.auth import JobSecret
from edl_argo.rpc.channel import MAX_MESSAGE_BYTES
from edl_argo.rpc.chunked import ChunkedMethod, chunked_service, message_of
from edl_argo.rpc.health import PING_METHOD
from edl_argo.rpc.ps_layout import CHUNKED_SERVICE, TENSOR_PORT_METHODS
from edl_argo.rpc.server_limits import ServerLimits
from edl_argo.rpc.sockets import open_listener
from edl_argo.rpc.tensor_port import TensorPortServer
from edl_argo.rpc.tls import TlsFiles

if TYPE_CHECKING:  # TensorFlow
    from edl_argo.ps.servicer import ParameterServerServicer

log = get_logger(__name__)

#: The calls the job's progress depends on, served from a pool of their own (:func:`ps_server_limits`): a
#: worker's start (PushModel) and training step (pulls and pushes), the master's count of the versions at the
#: end of training (GetStatus) and its liveness check (a PS that leaves it unanswered is replaced). The
#: others (single-table pulls, whole-table pulls for the export) share the other pool.
PROGRESS_METHODS = (
    *(
        f"/edl_argo.ParameterServer/{name}"
        for name in (
            "PushModel",
            "PullDenseParameters",
            "PullEmbeddingVectorsBatch",
            "PushGradients",
            "GetStatus",
        )
    ),
    *(f"/{CHUNKED_SERVICE}/{name}" for name in ("PushGradients", "PullDenseParameters")),
    PING_METHOD,
)
PROGRESS_THREADS = 8
#: Threads of the other calls, and calls in progress at most (beyond: RESOURCE_EXHAUSTED at once, a status
#: workers do not retry): the larger of :data:`MAX_CONCURRENT_CALLS` and :data:`CALLS_PER_WORKER` per worker
#: the job may have (a worker's step, its prefetching pull and an embedding pull).
OTHER_THREADS = 4
MAX_CONCURRENT_CALLS = 64
CALLS_PER_WORKER = 3
#: A connection is asked to go away after this long (its client opens a new one).
CONNECTION_SECONDS = 60.0
#: The longest a handler may legitimately run beyond its caller's deadline: none waits for another peer,
#: so this is only the time to finish the work in hand (applying a push of the largest message).
HANDLER_SLACK_SECONDS = 10.0


def ps_server_limits(rpc_timeout_seconds: float, max_workers: int = 0) -> ServerLimits:
    """A parameter server's bounds: :data:`PROGRESS_METHODS` on :data:`PROGRESS_THREADS` threads of their
    own, at most :data:`MAX_CONCURRENT_CALLS` calls at once or :data:`CALLS_PER_WORKER` per worker of
    ``max_workers`` (the most the job may have) if more, and no call lasting longer than the callers'
    deadline (``--rpc-timeout-seconds``) plus the handlers' slack (a client that sends a call's headers
    and never its body holds a thread that long at most, and its request's arrival 10 s at most)."""
    return ServerLimits(
        threads=OTHER_THREADS,
        priority_methods=PROGRESS_METHODS,
        priority_threads=PROGRESS_THREADS,
        max_concurrent_calls=max(MAX_CONCURRENT_CALLS, CALLS_PER_WORKER * max_workers),
        connection_seconds=CONNECTION_SECONDS,
        max_call_seconds=rpc_timeout_seconds + HANDLER_SLACK_SECONDS,
    )


def large_message_methods(servicer: ParameterServerServicer) -> dict[str, ChunkedMethod]:
    """The methods whose messages scale with the model, by name: how each reads its request and which
    handler (the unary method's) answers it. gRPC serves them as streams of chunks
    (:func:`add_chunked_service`), the tensor port over plain TCP (:func:`start_tensor_port`)."""
    return {
        "PushGradients": ChunkedMethod(PushedGradients.parse, servicer.PushGradients),
        "PullDenseParameters": ChunkedMethod(
            message_of(ps_pb2.PullDenseParametersRequest), servicer.PullDenseParameters
        ),
    }


def add_chunked_service(server: grpc.Server, servicer: ParameterServerServicer, limits: ServerLimits) -> None:
    """Serve :data:`CHUNKED_SERVICE`: the push and the dense pull as streams of chunks, answered by the
    unary methods' handlers, with the requests' arrival bounded as ``limits`` bounds the unary calls'."""
    methods = large_message_methods(servicer)
    server.add_generic_rpc_handlers(
        [chunked_service(CHUNKED_SERVICE, methods, MAX_MESSAGE_BYTES, limits.request_arrival_seconds)]
    )


def start_tensor_port(
    servicer: ParameterServerServicer,
    host: str,
    port: int,
    secret: JobSecret | None,
    limits: ServerLimits,
    tls: TlsFiles | None = None,
) -> TensorPortServer:
    """Serve the large-message methods on ``host:port`` over plain TCP (:mod:`edl_argo.rpc.tensor_port`);
    any free port if ``port`` is 0 or taken (logged ``ps_tensor_port_taken``). Requests arrive within, and
    answers leave within, what ``limits`` allows a gRPC call; connections at most its calls at once. The
    servicer's ``GetStatus`` names the port from then on. With ``tls``, TLS only, as the gRPC port."""
    listener = open_listener(host, port)
    if listener is None:
        log.warning("ps_tensor_port_taken", port=port, fallback="any free port")
        listener = open_listener(host, 0)
    assert listener is not None  # port 0 is never taken
    methods = large_message_methods(servicer)
    server = TensorPortServer(
        listener,
        {number: (name, methods[name]) for number, name in enumerate(TENSOR_PORT_METHODS, start=1)},
        secret=secret,
        limit=MAX_MESSAGE_BYTES,
        arrival_seconds=limits.request_arrival_seconds,
        answer_seconds=limits.max_call_seconds,
        max_connections=limits.max_concurrent_calls or MAX_CONCURRENT_CALLS,
        tls=tls.server_context() if tls is not None else None,
    )
    servicer.tensor_port = join_host_port(host, server.port)
    return server
