"""Bounds on what a gRPC server's clients can hold: threads, concurrent calls, and how long any call lasts.

gRPC's synchronous server gives each call a thread of its pool as soon as the call's headers arrive, and
that thread waits for the request body without a bound of its own: a client that sends headers and nothing
more (a buggy or hostile one) holds a thread for as long as it keeps the connection. So a server made with
:class:`ServerLimits`:

* serves the methods its job's progress depends on (``priority_methods``) from a pool of their own, so that
  calls of the other methods (however many, however slow their bodies) never take a thread from them;
* refuses calls beyond ``max_concurrent_calls`` in progress at once with ``RESOURCE_EXHAUSTED`` instead of
  queueing them without limit;
* ends every call within ``connection_seconds + max_call_seconds``: each connection is told to go away
  (HTTP/2 GOAWAY) after ``connection_seconds`` (clients open a new one for their next calls) and is closed,
  with whatever calls it still holds, ``max_call_seconds`` later. A real call is bounded by its client's
  deadline well before;
* cancels a unary call whose request has not arrived ``request_arrival_seconds`` after its headers, and
  answers bytes that are no valid request ``INVALID_ARGUMENT`` (:mod:`edl_argo.rpc.request_deadline`);
* lets calls that arrive faster than the server takes them wait, instead of having gRPC cancel them. gRPC's
  core holds a call until the Python server's one serving thread takes it (which needs the GIL: a busy
  server takes calls slowly), and by default cancels new calls at random once 1,000 wait, all beyond 3,000,
  and any that waited 30 s, with ``CANCELLED`` (status and details), a status clients do not retry: 5,000
  workers made their master cancel thousands of calls so. A server with ``max_concurrent_calls`` lets as
  many wait as it admits (:meth:`ServerLimits.options`), and lets a call wait for as long as a call may
  last, so that its client's deadline ends it first (``DEADLINE_EXCEEDED``, which clients retry).

The master's and the parameter servers' bounds are declared in ``edl_argo/master/serving.py`` and
``edl_argo/ps/serving.py``; :func:`edl_argo.rpc.channel.make_server` applies them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc.experimental import wrap_server_method_handler

from edl_argo.rpc.request_deadline import REQUEST_ARRIVAL_SECONDS, RequestDeadlineInterceptor

#: Calls gRPC's core lets wait for the server to take them, at least (its own default: 1,000 before it
#: cancels some at random, 3,000 before it cancels every new one).
CORE_WAITING_CALLS = 3000


@dataclass(frozen=True)
class ServerLimits:
    """The bounds of one server (see the module docstring). ``priority_methods``: full method names
    (``/package.Service/Method``) served from a pool of ``priority_threads`` threads of their own."""

    threads: int = 8
    priority_methods: Collection[str] = ()
    priority_threads: int = 8
    max_concurrent_calls: int | None = None
    connection_seconds: float = 60.0
    max_call_seconds: float = 120.0
    request_arrival_seconds: float = REQUEST_ARRIVAL_SECONDS

    def options(self) -> list[tuple[str, int]]:
        """The channel arguments that bound a connection's (and so every call's) life, and those that let as
        many calls wait to be taken as the server admits (:data:`CORE_WAITING_CALLS` at least; beyond, gRPC
        cancels them), for as long as a call may last (see the module docstring)."""
        waiting = max(CORE_WAITING_CALLS, self.max_concurrent_calls or 0)
        return [
            ("grpc.max_connection_age_ms", int(self.connection_seconds * 1000)),
            ("grpc.max_connection_age_grace_ms", int(self.max_call_seconds * 1000)),
            ("grpc.server.max_pending_requests", waiting),
            ("grpc.server.max_pending_requests_hard_limit", waiting),
            (
                "grpc.server_max_unrequested_time_in_server",
                math.ceil(self.connection_seconds + self.max_call_seconds),
            ),
        ]

    def interceptors(self, inner: Sequence[grpc.ServerInterceptor] = ()) -> list[grpc.ServerInterceptor]:
        """The server's interceptors around ``inner`` (authentication): the priority pool outermost, so that
        it is set on the handler gRPC runs, and the request deadline innermost, around the method itself (a
        call ``inner`` refuses is not decoded at all)."""
        pool: list[grpc.ServerInterceptor] = []
        if self.priority_methods:
            threads = futures.ThreadPoolExecutor(self.priority_threads, thread_name_prefix="grpc-priority")
            pool.append(_PriorityPool(frozenset(self.priority_methods), threads))
        return [*pool, *inner, RequestDeadlineInterceptor(self.request_arrival_seconds)]


class _PriorityPool(grpc.ServerInterceptor):
    """Serves ``methods`` from ``pool``: gRPC runs a behaviour with an ``experimental_thread_pool`` there."""

    def __init__(self, methods: frozenset[str], pool: futures.ThreadPoolExecutor) -> None:
        self._methods = methods
        self._pool = pool

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler
        return wrap_server_method_handler(self._on_pool, handler)

    def _on_pool(self, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            return behaviour(*args)

        run.experimental_thread_pool = self._pool  # type: ignore[attr-defined]
        return run
