"""Large messages as streams of chunks: the transport of a push's gradients and a pull's parameters.

gRPC's Python binding moves one large message slowly: a 100 MB request and its 100 MB answer took 430 ms on
loopback, where the same bytes as a stream of 4 MiB messages took 145 ms (``docs/profile.md``). So the calls
whose messages scale with the model have a streaming twin (``ParameterServerChunks`` in ``ps.proto``): the
client serializes the request as for the unary call, cuts it into ``Chunk`` messages of at most
:data:`CHUNK_BYTES`, the server reads the request from them and runs the unary method's handler, and its
answer travels back the same way. The messages are the unary call's: only their transport differs, so
every check and answer of the unary method holds for its twin.

The chunks are encoded and decoded by hand (:mod:`edl_argo.rpc.wire`) from the pieces of an
:class:`~edl_argo.rpc.wire.Encoding`, with no protobuf object per chunk: each byte of a tensor is copied
once into its chunk, and the receiver reads the message from the chunks as they came (a
:class:`~edl_argo.rpc.rope.Rope`), copying a tensor's bytes once, into an array of its own.

A message's final chunk is marked ``last``, and a stream of chunks that ends without it is never read: on
the server, a call its client cancelled may end so. :class:`PendingCall` relies on it: it sends a request
but for its last bytes, which it sends later, or never (it cancels the call).

Bounds: a joined request or answer larger than :data:`~edl_argo.rpc.channel.MAX_MESSAGE_BYTES` is refused
as the unary call's would be (``RESOURCE_EXHAUSTED``), and a request that has not arrived in full within
the server's request-arrival time is cancelled (:mod:`edl_argo.rpc.request_deadline`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from edl_argo.proto import ps_pb2
from edl_argo.rpc.request_deadline import receive_within
from edl_argo.rpc.rope import Rope
from edl_argo.rpc.wire import Encoding, WireError, length_prefix, serialized, split_field

#: The most bytes of a message one chunk carries.
CHUNK_BYTES = 4 << 20
#: ``Chunk.data``'s field number.
_DATA = ps_pb2.Chunk.DESCRIPTOR.fields_by_name["data"].number
#: ``Chunk.last`` set, serialized.
_LAST = ps_pb2.Chunk(last=True).SerializeToString()

Response = TypeVar("Response")


class MessageTooLargeError(ValueError):
    """Chunks that add up to more than the message limit."""


class IncompleteMessageError(ValueError):
    """Chunks that end before the one marked last (a stream cut short), or go on after it."""


def cut(message: bytes | Encoding, size: int = CHUNK_BYTES, last: bool = True) -> Iterator[bytes]:
    """The serialized ``Chunk`` messages that carry ``message`` in order, each with at most ``size`` of its
    bytes (one chunk, possibly empty, for an empty message); the final one marked ``last`` unless more of
    the message follows (``last=False``: :class:`PendingCall`). An :class:`Encoding`'s pieces are read as
    the chunks are made: they must not change before the last one is."""
    held: list[bytes | memoryview] | None = None  # the parts of the chunk made last, not yet sent
    for parts in _chunk_parts(message, size):
        if held is not None:
            yield _chunk(held, marked=False)
        held = parts
    assert held is not None  # _chunk_parts makes one chunk at least
    yield _chunk(held, marked=last)


def _chunk_parts(message: bytes | Encoding, size: int) -> Iterator[list[bytes | memoryview]]:
    """The views of ``message`` each chunk of :func:`cut` carries."""
    pieces = message.pieces if isinstance(message, Encoding) else (message,)
    parts: list[bytes | memoryview] = []
    filled = 0
    for piece in pieces:
        view = memoryview(piece)
        while len(view):
            taken = view[: size - filled]
            parts.append(taken)
            filled += len(taken)
            view = view[len(taken) :]
            if filled == size:
                yield parts
                parts, filled = [], 0
    if parts or not any(len(piece) for piece in pieces):
        yield parts


def _chunk(parts: list[bytes | memoryview], marked: bool) -> bytes:
    size = sum(len(part) for part in parts)
    return b"".join([length_prefix(_DATA, size), *parts, _LAST if marked else b""])


def gather(chunks: Iterable[bytes], limit: int) -> Rope:
    """The message the serialized ``Chunk`` messages ``chunks`` carry, in order, as a :class:`Rope` of
    views of their bytes (:meth:`Rope.joined` for the bytes).

    Raises :class:`MessageTooLargeError` as soon as they carry more than ``limit`` bytes,
    :class:`~edl_argo.rpc.wire.WireError` for a chunk that is no ``Chunk``, and
    :class:`IncompleteMessageError` when they end without the chunk marked last (the stream was cut short:
    a cancelled call's may end so on the server) or go on after it."""
    parts: list[memoryview] = []
    total = 0
    ended = False
    for chunk in chunks:
        if ended:
            raise IncompleteMessageError("chunks came after the message's last one")
        rest, data = split_field(chunk, _DATA)
        if data:  # the last occurrence of a field wins, as protobuf reads it
            total += len(data[-1])
            if total > limit:
                raise MessageTooLargeError(f"the chunks carry more than a message's {limit:,} bytes")
            parts.append(data[-1])
        ended = bool(rest) and _marked_last(rest)
    if not ended:
        raise IncompleteMessageError("the chunks ended before the message's last one")
    return Rope(parts)


def _marked_last(fields: bytes) -> bool:
    """Whether a ``Chunk`` without its data says it is the message's last."""
    try:
        return ps_pb2.Chunk.FromString(fields).last
    except DecodeError as error:
        raise WireError(f"a chunk does not parse: {error}") from None


def message_of(message_type: type[Message]) -> Callable[[Rope], Message]:
    """Reads a rope's bytes as a message of ``message_type`` (for a small message)."""
    return lambda rope: message_type.FromString(rope.joined())


# ---------------------------------------------------------------------------------------------- server


@dataclass(frozen=True)
class ChunkedMethod:
    """The streaming twin of a unary method: how its serialized request is read from the received chunks
    (e.g. :func:`message_of` its type; raising protobuf's ``DecodeError`` or a ``ValueError`` for bytes that
    are no request), and its handler (the unary method's own), whose answer is a message, a serialized
    message or an :class:`Encoding`."""

    parse: Callable[[Rope], Any]
    handler: Callable[[Any, grpc.ServicerContext], Message | bytes | Encoding]

    def answer(self, data: Rope, context: grpc.ServicerContext, name: str) -> bytes | Encoding:
        """The serialized answer to the request ``data`` holds. A request that is no valid message ends the
        call ``INVALID_ARGUMENT`` (``context.abort``), its reason naming ``name``. Every transport of the
        method (gRPC's chunks, the PS's tensor port) answers through here."""
        try:
            request = self.parse(data)
        except (DecodeError, ValueError) as error:  # ValueError: WireError, TensorDecodeError
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{name}: the request is no valid message ({error})"
            )
            raise AssertionError("unreachable: context.abort raises") from None
        return serialized(self.handler(request, context))


def chunked_service(
    service: str, methods: Mapping[str, ChunkedMethod], limit: int, arrival_seconds: float
) -> grpc.GenericRpcHandler:
    """The handlers of ``service``'s streaming twins of ``methods`` (by method name), for
    ``server.add_generic_rpc_handlers``: requests up to ``limit`` bytes, which must arrive in full within
    ``arrival_seconds``."""
    handlers = {
        name: grpc.stream_stream_rpc_method_handler(
            _serve(f"/{service}/{name}", method, limit, arrival_seconds)
        )
        for name, method in methods.items()
    }
    return grpc.method_handlers_generic_handler(service, handlers)


def _serve(
    full_name: str, method: ChunkedMethod, limit: int, arrival_seconds: float
) -> Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[bytes]]:
    def behaviour(chunks: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            data = receive_within(lambda: gather(chunks, limit), context, full_name, arrival_seconds)
        except MessageTooLargeError as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{full_name}: {error}")
        except WireError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{full_name}: a chunk is not a Chunk ({error})")
        except IncompleteMessageError as error:
            # Also how a call cancelled before its request ended may end here: never read.
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{full_name}: {error}")
        yield from cut(method.answer(data, context, full_name))

    return behaviour


# ---------------------------------------------------------------------------------------------- client


class ChunkedCall(Generic[Response]):
    """Calls a streaming twin on ``channel``: ``call(request, timeout)`` sends the serialized ``request``
    in chunks and returns ``parse`` of the answer's chunks (a ``grpc.RpcError`` as the unary call's)."""

    def __init__(
        self, channel: grpc.Channel, full_name: str, parse: Callable[[Rope], Response], limit: int
    ) -> None:
        self._rpc = channel.stream_stream(full_name)
        self._parse = parse
        self._limit = limit

    def __call__(self, request: bytes | Encoding | Message, timeout: float) -> Response:
        return self._read(self._rpc(cut(serialized(request)), timeout=timeout))

    def start(self, body: bytes | Encoding, timeout: float) -> PendingCall[Response]:
        """Send the serialized request ``body`` now and its last bytes later (:class:`PendingCall`)."""
        return PendingCall(self, body, timeout)

    def _read(self, answer: Any) -> Response:
        try:
            return self._parse(gather(answer, self._limit))
        except (MessageTooLargeError, ValueError, DecodeError) as error:  # ValueError: WireError, ...
            answer.cancel()
            raise CallError(grpc.StatusCode.INTERNAL, str(error)) from None


class PendingCall(Generic[Response]):
    """A call of a streaming twin whose request is sent but for its last bytes, which :meth:`finish`
    sends, or which :meth:`cancel` never sends. The server reads a request only once it has arrived in
    full, so it never handles a cancelled one.

    Protobuf reads a message's fields in any order (the last occurrence of a scalar wins): ``body`` and the
    ``tail`` given to :meth:`finish` are one serialized message when joined. The caller must call
    :meth:`finish` or :meth:`cancel`; the request waits for its tail at most the call's ``timeout``, then the
    call is cancelled."""

    def __init__(self, call: ChunkedCall[Response], body: bytes | Encoding, timeout: float) -> None:
        self._call = call
        self._timeout = timeout
        self._tail: queue.Queue[bytes | None] = queue.Queue(maxsize=1)
        self._started = threading.Event()
        self._answer = call._rpc(self._chunks(body), timeout=timeout)
        self._started.set()

    def _chunks(self, body: bytes | Encoding) -> Iterator[bytes]:
        yield from cut(body, last=False)
        try:
            tail = self._tail.get(timeout=self._timeout)
        except queue.Empty:
            tail = None
        if tail is None:
            # Cancelled before the request ends: gRPC then sends nothing more, not even its end, so the
            # server never reads a request without its tail.
            self._started.wait(self._timeout)
            self._answer.cancel()
            return
        yield from cut(tail)

    def finish(self, tail: bytes) -> Response:
        """Send the request's last bytes and return the parsed answer (errors as :class:`ChunkedCall`'s)."""
        self._give(tail)
        return self._call._read(self._answer)

    def cancel(self) -> None:
        """Cancel the call before its request ends."""
        self._answer.cancel()
        self._give(None)

    def _give(self, tail: bytes | None) -> None:
        with contextlib.suppress(queue.Full):  # given already: the first word stands
            self._tail.put_nowait(tail)


class CallError(grpc.RpcError):
    """A call's failure that our own transport code raises, as gRPC raises its own: a status ``code`` (an
    answer that makes no message, from a broken or hostile server: ``INTERNAL``, not retried) and a one-line
    ``reason``."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self._code = code
        self._reason = reason

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._reason
