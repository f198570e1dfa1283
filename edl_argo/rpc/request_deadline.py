"""A server-side deadline for a unary call's request to arrive.

gRPC's synchronous server gives a call one of its threads as soon as the call's headers arrive, and that
thread then waits for the request message without a bound: a peer that opens calls and never sends their
requests (or a stalled network path) holds every thread, and the server stops answering. The interceptor
here serves every unary-unary method as a stream-unary one so that the handler gets its context before
the request, starts a timer, and cancels the call (the client sees ``CANCELLED``) when its request has not
arrived within ``seconds``. It also decodes the request itself, so that bytes that are no valid message
end with ``INVALID_ARGUMENT`` (gRPC's own decoding answers ``INTERNAL``). Requests that arrive in time and
decode are served exactly as before, and a response the method returns already serialized (``bytes``, see
:mod:`edl_argo.rpc.wire`) is sent as it is.

One thread per process watches every call's deadline (:class:`DeadlineWatcher`): a thread started and
stopped per call (``threading.Timer``) cost each call a thread start (the handler waits until the new
thread has the GIL), a wake-up and an exit, GIL hand-offs that a busy master could least afford.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from edl_argo.log import get_logger
from edl_argo.rpc.wire import Encoding

log = get_logger(__name__)

Received = TypeVar("Received")

#: How long after its headers a unary call's request may arrive before the call is cancelled.
REQUEST_ARRIVAL_SECONDS = 10.0


class RequestDeadlineInterceptor(grpc.ServerInterceptor):
    """Cancel unary calls whose request message has not arrived ``seconds`` after their headers."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler
        unary = handler.unary_unary
        deserialize = handler.request_deserializer
        method = handler_call_details.method
        seconds = self.seconds

        def behavior(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            request = receive_within(lambda: next(requests, None), context, method, seconds)
            if request is None:  # the client half-closed without a request
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method} requires one request message")
            if deserialize is not None:
                try:
                    request = deserialize(request)
                except Exception as error:  # protobuf's DecodeError, or a message of another method
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{method}: the request is not a valid message ({type(error).__name__})",
                    )
            return unary(request, context)

        return grpc.stream_unary_rpc_method_handler(
            behavior, response_serializer=_sending_bytes_as_they_are(handler.response_serializer)
        )


def receive_within(
    receive: Callable[[], Received], context: grpc.ServicerContext, method: str, seconds: float
) -> Received:
    """``receive()`` (reading a call's request), unless it takes longer than ``seconds``: then the call is
    cancelled (the client sees ``CANCELLED``) and ended, as it is when its client cancels it meanwhile."""
    watch = _WATCHER.call_later(seconds, lambda: _cancel_late(context, method, seconds))
    try:
        return receive()
    except grpc.RpcError:  # cancelled: by the watcher, or by the client
        context.abort(grpc.StatusCode.CANCELLED, f"{method}: the request did not arrive")
        raise AssertionError("unreachable: context.abort raises") from None
    finally:
        watch.cancel()


@dataclass(eq=False)
class Watch:
    """One deadline of a :class:`DeadlineWatcher`: ``action`` runs at ``due`` (``time.monotonic()``) unless
    :meth:`cancel` came first."""

    due: float
    action: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        """Do not run the action (it may be running already, or have run: then this does nothing). The
        action is let go at once: what it refers to (a call's context) is not kept until the deadline."""
        self.cancelled = True
        self.action = _nothing


def _nothing() -> None:
    pass


class DeadlineWatcher:
    """Runs actions after a delay, on one thread of its own (started at the first :meth:`call_later`) for
    any number of deadlines: they wait in a heap, a cancelled one is dropped when it comes due. Actions
    must be short (they run one after another); one that raises is logged and the others still run."""

    def __init__(self, name: str = "request-deadlines") -> None:
        self._name = name
        self._ready = threading.Condition()
        self._watches: list[tuple[float, int, Watch]] = []  # (due, order of arrival, watch): a heap
        self._numbers = itertools.count()
        self._thread: threading.Thread | None = None

    def call_later(self, seconds: float, action: Callable[[], None]) -> Watch:
        """Run ``action()`` ``seconds`` from now, unless the returned watch is cancelled before."""
        watch = Watch(time.monotonic() + seconds, action)
        with self._ready:
            heapq.heappush(self._watches, (watch.due, next(self._numbers), watch))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif self._watches[0][2] is watch:  # earlier than what the thread waits for
                self._ready.notify()
        return watch

    def pending(self) -> int:
        """Deadlines not come due yet, cancelled ones included (for tests)."""
        with self._ready:
            return len(self._watches)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._watches or self._watches[0][0] > time.monotonic():
                    self._ready.wait(self._watches[0][0] - time.monotonic() if self._watches else None)
                _, _, watch = heapq.heappop(self._watches)
            if watch.cancelled:
                continue
            try:
                watch.action()
            except Exception as error:  # one failed action must not stop the others' deadlines
                log.error("deadline_action_failed", error=f"{type(error).__name__}: {error}")


#: The process's watcher of every call's request deadline.
_WATCHER = DeadlineWatcher()


def _sending_bytes_as_they_are(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    if serializer is None:
        return None

    def serialize(response: Any) -> bytes:
        if isinstance(response, Encoding):
            return response.tobytes()
        return response if isinstance(response, bytes) else serializer(response)

    return serialize


def _cancel_late(context: grpc.ServicerContext, method: str, seconds: float) -> None:
    log.warning("request_late", rpc=method, seconds=seconds)
    context.cancel()
