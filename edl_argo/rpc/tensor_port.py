"""A parameter server's tensor port: its push and dense pull over plain TCP, beside gRPC.

gRPC's Python binding moves a 100 MB request and its 100 MB answer in 150-176 ms on loopback, however it is
tuned; a socket moves them in 78 ms (``docs/profile.md``). So a PS also serves the calls whose messages
scale with the model (the streaming twins of :mod:`edl_argo.rpc.chunked`) on a port of its own. The same
serialized messages travel, read by the same ``parse`` and answered by the same handler
(:class:`~edl_argo.rpc.chunked.ChunkedMethod`): every check and answer of the gRPC method holds here.

**Finding it.** A PS names its tensor port in ``GetStatus`` (``ParameterServerStatus.tensor_port``,
``host:port``; empty when it serves none). A client (:class:`TensorPort`) asks once, keeps connections
open between calls, and asks again after a connection failed. A call goes over gRPC instead when the PS
serves no tensor port, when the port cannot be reached (then for :data:`UNREACHABLE_SECONDS`, logged once
as ``ps_tensor_port_unreachable``) or when the server is at its connection cap.

**The wire** (little-endian). A connection opens with a hello, :data:`HELLO` (magic ``EDLH``, version, the
identity's and the token's lengths) then the caller's identity and token (:mod:`edl_argo.rpc.auth`). The
server answers it with a response frame: OK, or the status of its refusal and the reason, then closes.
Then each call is frames: :data:`HEADER` (magic ``EDLT``, kind, code, flags, the number of pieces, their
bytes), the pieces' lengths (uint64 each), then the pieces. A message travels as the pieces it was encoded
in (:class:`~edl_argo.rpc.wire.Encoding`: a tensor's content is one), and the receiver reads each large
piece into aligned memory of its own, which the tensor's array and then TensorFlow share without a copy
(:func:`~edl_argo.rpc.rope.read_tensor_rope`); small pieces are read together. The frames:

* ``REQUEST``: code = the method's number; the payload is the serialized request. With flag
  :data:`MORE`, a ``TAIL`` frame of the same code follows with the request's last bytes
  (:meth:`TensorCall.start`: protobuf reads the two as one message). A request whose tail never comes is
  never read, nor is one whose caller closed the connection after sending it (it gave up on the call, and
  will send it again: a PS paused past the deadline finds both in its buffer when it resumes).
* ``RESPONSE``: code = a gRPC status code's number; the payload is the serialized answer (OK) or the
  one-line reason.

One call at a time per connection.

**Bounds** (server). The hello must arrive within :data:`HELLO_SECONDS` and carry a token of the job
(refused: ``UNAUTHENTICATED``, logged once per peer host as ``tensor_port_unauthenticated``); a request,
tail included, within the request-arrival time from its header, at most the message limit
(``RESOURCE_EXHAUSTED``, then the connection closes), in at most :data:`MAX_PIECES` pieces, each
allocated as it comes (a large piece's memory is only reserved until its bytes arrive); a connection
silent for :data:`IDLE_SECONDS` between calls is closed; beyond the connection cap the idlest closes; a
frame that breaks the protocol closes its connection (``tensor_port_frame_rejected``). A server that stops
accepts no more connections and lets the calls it is serving finish and answer within its grace, as gRPC's
does (:meth:`TensorPortServer.stop`).

**TLS.** With the job's TLS files (:mod:`edl_argo.rpc.tls`), the port speaks TLS only: the server presents
the gRPC certificate, the client checks it as gRPC's clients do, both before the hello.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Generic, NamedTuple, NoReturn, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from edl_argo.addresses import AddressError, parse_host_port
from edl_argo.log import get_logger
from edl_argo.rpc.auth import IDENTITY_KEY, ClientCredential, JobSecret, PeersLogged
from edl_argo.rpc.chunked import CallError, ChunkedCall, ChunkedMethod, IncompleteMessageError, PendingCall
from edl_argo.rpc.rope import Rope, aligned_empty
from edl_argo.rpc.sockets import SocketServer, connect, peer_host, recv_exact, recv_exact_into, send_parts
from edl_argo.rpc.tls import SERVER_NAME
from edl_argo.rpc.wire import Encoding, serialized

log = get_logger(__name__)

Response = TypeVar("Response")

HELLO_MAGIC = b"EDLH"
FRAME_MAGIC = b"EDLT"
PROTOCOL_VERSION = 1
#: magic, version, identity bytes, token bytes.
HELLO = struct.Struct("<4sBBH")
#: magic, kind, code, flags, reserved, pieces, payload bytes.
HEADER = struct.Struct("<4sBBBBIQ")
REQUEST, TAIL, RESPONSE = 1, 2, 3
#: A ``REQUEST``'s flag: a ``TAIL`` frame follows.
MORE = 1
#: The most bytes of a tail, and of a refusal's reason.
TAIL_LIMIT = 64 << 10
#: The most pieces a message may come in.
MAX_PIECES = 1 << 18
#: A piece this large is received into aligned memory of its own; smaller ones are read together, into
#: buffers of at most :data:`SMALL_PIECES_BYTES`.
OWN_MEMORY_BYTES = 64 << 10
SMALL_PIECES_BYTES = 4 << 20
#: How long a new connection's hello may take.
HELLO_SECONDS = 10.0
#: A connection silent this long between calls is closed (a client opens a new one).
IDLE_SECONDS = 120.0
#: After a tensor port could not be reached, calls go over gRPC this long before it is tried again.
UNREACHABLE_SECONDS = 30.0
#: The longest a client waits to connect to a tensor port (then the call goes over gRPC).
CONNECT_SECONDS = 5.0
#: Idle connections a client keeps per PS.
IDLE_CONNECTIONS = 4


class FrameError(ConnectionError):
    """Bytes that break the protocol; the connection closes."""


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def hello(identity: str, token: str) -> bytes:
    """The bytes a connection opens with, presenting ``identity`` and its ``token``."""
    credential = (identity.encode(), token.encode())
    return HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, *map(len, credential)) + b"".join(credential)


class _Header(NamedTuple):
    kind: int
    code: int
    flags: int
    pieces: int
    size: int


def _frame(kind: int, code: int, parts: Sequence[bytes | memoryview], flags: int = 0) -> list[Any]:
    """A frame of ``parts`` (the pieces of a message), ready to send."""
    pieces = [part for part in parts if len(part)]
    lengths = [len(piece) for piece in pieces]
    header = HEADER.pack(FRAME_MAGIC, kind, code, flags, 0, len(pieces), sum(lengths))
    return [header, struct.pack(f"<{len(lengths)}Q", *lengths), *pieces]


def _read_header(sock: socket.socket, deadline: float | None) -> _Header | None:
    """The next frame's header; None when the peer closed between frames."""
    data = bytearray(HEADER.size)
    if recv_exact_into(sock, memoryview(data), deadline) == 0:
        return None
    magic, kind, code, flags, _, pieces, size = HEADER.unpack(data)
    if magic != FRAME_MAGIC:
        raise FrameError(f"a frame starts with {bytes(magic)!r}, not {FRAME_MAGIC!r}")
    if pieces > MAX_PIECES or pieces > size:
        raise FrameError(f"a frame of {size} bytes in {pieces} pieces")
    return _Header(kind, code, flags, pieces, size)


def _receive(sock: socket.socket, header: _Header, deadline: float, what: str) -> list[memoryview]:
    """The pieces of the frame ``header`` began: each large one in aligned memory of its own, runs of
    small ones together."""
    table = bytearray(8 * header.pieces)
    recv_exact(sock, memoryview(table), deadline, f"{what}'s piece table")
    lengths = np.frombuffer(table, dtype="<u8")
    if (
        not lengths.all()
        or int(lengths.sum(dtype=np.uint64)) != header.size
        or lengths.max(initial=0) > header.size
    ):
        raise FrameError(f"{what}: a piece table that does not add up to {header.size} bytes")
    parts: list[memoryview] = []
    small = 0  # bytes of the run of small pieces not read yet
    for length in [*lengths.tolist(), None]:
        if small and (length is None or length >= OWN_MEMORY_BYTES or small + length > SMALL_PIECES_BYTES):
            parts.append(memoryview(np.empty(small, dtype=np.uint8)))
            recv_exact(sock, parts[-1], deadline, what)
            small = 0
        if length is None:
            break
        if length >= OWN_MEMORY_BYTES:
            parts.append(aligned_empty(length))
            recv_exact(sock, parts[-1], deadline, what)
        else:
            small += length
    return parts


def _parts(message: bytes | Encoding | Message) -> list[bytes | memoryview]:
    """A message's bytes as the pieces to send."""
    data = serialized(message)
    return list(data.pieces) if isinstance(data, Encoding) else [data]


# ---------------------------------------------------------------------------------------------- server


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _CallContext:
    """What the handlers read of a gRPC ``ServicerContext``: the caller's identity, its peer, and
    ``abort``."""

    def __init__(self, identity: str | None, peer: str) -> None:
        self._metadata = ((IDENTITY_KEY, identity),) if identity is not None else ()
        self._peer = peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return f"ipv4:{self._peer}"

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float | None:
        return None

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _Aborted(code, details)


class TensorPortServer:
    """Serves ``methods`` (by method number) on ``listener`` until :meth:`stop` (see the module docstring
    for the bounds). With ``secret``, only connections with a credential of that job; without one, any."""

    def __init__(
        self,
        listener: socket.socket,
        methods: Mapping[int, tuple[str, ChunkedMethod]],
        *,
        secret: JobSecret | None,
        limit: int,
        arrival_seconds: float,
        answer_seconds: float,
        max_connections: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._methods = dict(methods)
        self._secret = secret
        self._limit = limit
        self._arrival_seconds = arrival_seconds
        self._answer_seconds = answer_seconds
        self._refused = PeersLogged()
        self._calls = 0  # calls being served
        self._calls_changed = threading.Condition()
        self._tls = tls
        wrap = self._handshake if tls is not None else None
        self._server = SocketServer(listener, self._serve, "tensor_port", max_connections, wrap)
        self.port = self._server.port

    def _handshake(self, sock: socket.socket) -> socket.socket:
        assert self._tls is not None
        return _tls_handshake(self._tls, sock, HELLO_SECONDS, server_side=True)

    def stop(self, grace: float = 0.0) -> None:
        """Accept no more connections, let the calls being served finish and answer for up to ``grace``
        seconds (their connections then close), then close every connection."""
        self._server.stop_accepting()
        deadline = time.monotonic() + grace
        with self._calls_changed:
            while self._calls and time.monotonic() < deadline:
                self._calls_changed.wait(deadline - time.monotonic())
        self._server.stop()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            identity = self._hello(sock, peer)
            if identity is None:
                return
            context = _CallContext(identity or None, peer)
            while not self._server.stopping and self._call(sock, context):
                self._server.touch(sock)
        except FrameError as error:
            log.warning("tensor_port_frame_rejected", peer=peer, reason=str(error))
        except OSError as error:  # the peer went away, or was too slow
            if not self._server.stopping:
                log.debug("tensor_port_connection_lost", peer=peer, error=str(error))

    def _hello(self, sock: socket.socket, peer: str) -> str | None:
        """The identity a new connection presents ("" without one, on a server of no job); None when it is
        refused (answered, to be closed)."""
        deadline = time.monotonic() + HELLO_SECONDS
        data = bytearray(HELLO.size)
        recv_exact(sock, memoryview(data), deadline, "a hello")
        magic, version, identity_bytes, token_bytes = HELLO.unpack(data)
        if magic != HELLO_MAGIC or version != PROTOCOL_VERSION or token_bytes > TAIL_LIMIT:
            raise FrameError(f"no tensor port hello of version {PROTOCOL_VERSION}")
        credential = bytearray(identity_bytes + token_bytes)
        recv_exact(sock, memoryview(credential), deadline, "a hello's credential")
        identity = credential[:identity_bytes].decode(errors="replace")
        token = credential[identity_bytes:].decode(errors="replace")
        if self._secret is not None and not self._secret.verify(identity, token):
            host = peer_host(peer)
            if self._refused.first(host):
                log.warning("tensor_port_unauthenticated", peer=host, port=self.port)
            self._answer(sock, grpc.StatusCode.UNAUTHENTICATED, "tensor port: wrong credential for this job")
            return None
        self._answer(sock, grpc.StatusCode.OK, b"")
        return identity

    def _call(self, sock: socket.socket, context: _CallContext) -> bool:
        """Serve the connection's next call; False when the connection is to close."""
        header = _read_header(sock, time.monotonic() + IDLE_SECONDS)
        if header is None:
            return False
        with self._calls_changed:
            self._calls += 1
        try:
            return self._serve_call(sock, context, header)
        finally:
            with self._calls_changed:
                self._calls -= 1
                self._calls_changed.notify_all()

    def _serve_call(self, sock: socket.socket, context: _CallContext, header: _Header) -> bool:
        deadline = time.monotonic() + self._arrival_seconds
        if header.kind != REQUEST or header.code not in self._methods:
            raise FrameError(f"a frame of kind {header.kind} and code {header.code} where a request belongs")
        name, method = self._methods[header.code]
        if header.size > self._limit:
            reason = f"{name}: a request of {header.size:,} bytes, more than a message's {self._limit:,}"
            self._answer(sock, grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
            return False
        parts = _receive(sock, header, deadline, f"{name}'s request")
        if header.flags & MORE:
            tail = _read_header(sock, deadline)
            if tail is None:
                return False  # cancelled before its request ended: never read
            if tail.kind != TAIL or tail.code != header.code or tail.size > TAIL_LIMIT:
                raise FrameError(f"{name}: a frame of kind {tail.kind} where the request's tail belongs")
            parts += _receive(sock, tail, deadline, f"{name}'s tail")
        if _unread(sock) == b"":
            # The caller closed the connection after its request: it gave up on the call (its deadline
            # passed while this server was paused, say) and will send it again, perhaps elsewhere. Never read.
            log.info("tensor_port_call_abandoned", rpc=name, peer=context.peer())
            return False
        try:
            answer = method.answer(Rope(parts), context, name)  # type: ignore[arg-type]
        except _Aborted as aborted:
            self._answer(sock, aborted.code, aborted.reason)
            return True
        except Exception as error:  # the handlers turn their errors into statuses: a bug
            log.error("tensor_port_request_failed", exc_info=True, rpc=name)
            self._answer(sock, grpc.StatusCode.INTERNAL, f"{name} failed: {type(error).__name__}")
            return True
        frame = _frame(RESPONSE, 0, _parts(answer))
        send_parts(sock, frame, time.monotonic() + self._answer_seconds)
        return True

    def _answer(self, sock: socket.socket, code: grpc.StatusCode, payload: bytes | str) -> None:
        data = payload.encode()[:TAIL_LIMIT] if isinstance(payload, str) else payload
        send_parts(sock, _frame(RESPONSE, code.value[0], [data]), time.monotonic() + self._answer_seconds)


# ---------------------------------------------------------------------------------------------- client


class TensorPort:
    """A client's connections to one PS's tensor port (thread-safe). ``locate(timeout)`` returns the
    port's ``host:port`` as the PS names it ("" for none; raises ``grpc.RpcError`` when the PS cannot be
    asked). ``name`` names the PS in logs."""

    def __init__(
        self,
        name: str,
        locate: Callable[[float], str],
        credential: ClientCredential | None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: a client context (:meth:`~edl_argo.rpc.tls.TlsFiles.client_context`) when the job's
        traffic is TLS."""
        self.name = name
        self._locate = locate
        self._tls = tls
        self._hello = (
            hello(credential.identity, credential.token) if credential is not None else hello("", "")
        )
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._address: tuple[str, int] | None = None
        self._grpc_until = 0.0  # calls go over gRPC until then
        self._warned = False

    def connection(self, deadline: float) -> socket.socket | None:
        """An open connection (an idle one, or a new one), or None: the call is to go over gRPC. Raises
        :class:`CallError` ``UNAUTHENTICATED`` when the port refuses this caller's credential."""
        with self._lock:
            if time.monotonic() < self._grpc_until:
                return None
            while self._idle:
                sock = self._idle.pop()
                if _unread(sock) is None:  # the PS sends nothing between calls: else it closed it
                    return sock
                sock.close()
        for _ in range(2):  # an address known from before may be stale (a relaunched PS): ask once more
            remembered = self._address
            try:
                target = remembered or self._find(deadline)
            except grpc.RpcError:
                return None  # the PS cannot be asked: neither can its gRPC methods, which will say so
            if target is None:
                return None
            try:
                return self._open(target, deadline)
            except CallError as error:
                if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise
                return None  # e.g. at its connection cap: this call goes over gRPC
            except OSError as error:
                self._address = None
                if remembered is None:
                    self._unreachable(target, str(error))
                    return None
        return None

    def _open(self, target: tuple[str, int], deadline: float) -> socket.socket:
        """A new connection to ``target`` past its hello (TLS first, with TLS)."""
        sock = connect(target, min(deadline, time.monotonic() + CONNECT_SECONDS))
        if self._tls is not None:
            sock = self._handshake(sock, deadline)
        try:
            send_parts(sock, [self._hello], deadline)
            _read_answer(sock, deadline, f"{self.name}'s tensor port")
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket, deadline: float) -> socket.socket:
        assert self._tls is not None
        seconds = min(deadline - time.monotonic(), CONNECT_SECONDS)
        return _tls_handshake(self._tls, sock, seconds, server_hostname=SERVER_NAME)

    def _find(self, deadline: float) -> tuple[str, int] | None:
        address = self._locate(max(0.1, min(CONNECT_SECONDS, deadline - time.monotonic())))
        if not address:
            with self._lock:  # the PS serves none: ask again later (a relaunched PS may)
                self._grpc_until = time.monotonic() + UNREACHABLE_SECONDS
            return None
        try:
            self._address = parse_host_port(address)
        except AddressError as error:
            self._unreachable(None, str(error))
            return None
        return self._address

    def _unreachable(self, target: tuple[str, int] | None, reason: str) -> None:
        with self._lock:
            self._address = None
            self._grpc_until = time.monotonic() + UNREACHABLE_SECONDS
            warned, self._warned = self._warned, True
        if not warned:
            log.warning(
                "ps_tensor_port_unreachable",
                ps=self.name,
                port=f"{target[0]}:{target[1]}" if target else "",
                reason=reason[:200],
                grpc_seconds=UNREACHABLE_SECONDS,
            )

    def release(self, sock: socket.socket) -> None:
        """Keep ``sock`` (its call ended cleanly) for a later call."""
        with self._lock:
            if len(self._idle) < IDLE_CONNECTIONS:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def _tls_handshake(
    context: ssl.SSLContext,
    sock: socket.socket,
    seconds: float,
    server_side: bool = False,
    server_hostname: str | None = None,
) -> socket.socket:
    """``sock`` as a TLS socket of ``context`` once its handshake is done, within ``seconds``; closed if
    the handshake fails."""
    try:
        wrapped = context.wrap_socket(
            sock, server_side=server_side, server_hostname=server_hostname, do_handshake_on_connect=False
        )
    except BaseException:
        sock.close()
        raise
    try:
        wrapped.settimeout(max(0.001, seconds))
        wrapped.do_handshake()
    except BaseException:
        wrapped.close()
        raise
    return wrapped


def _unread(sock: socket.socket) -> bytes | None:
    """What the peer sent that nobody read yet, looked at without waiting: ``b""`` when it closed (or reset)
    the connection, a byte when it sent data, None when nothing is waiting. A plain socket's data stays
    (``MSG_PEEK``); with TLS, a record is read (one of no data, such as a session ticket, gives None)."""
    if not select.select([sock], [], [], 0)[0]:
        return None
    try:
        sock.setblocking(False)  # every read and write sets its own deadline again
        if isinstance(sock, ssl.SSLSocket):
            return sock.recv(1)
        return sock.recv(1, socket.MSG_PEEK)
    except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def _read_answer(sock: socket.socket, deadline: float, source: str) -> list[memoryview]:
    """The payload of an OK response; :class:`CallError` with the server's status otherwise."""
    header = _read_header(sock, deadline)
    if header is None:
        raise ConnectionError(f"{source} closed the connection before answering")
    if header.kind != RESPONSE or header.code not in _CODES:
        raise FrameError(
            f"{source}: a frame of kind {header.kind} and code {header.code} where an answer belongs"
        )
    status = _CODES[header.code]
    if status != grpc.StatusCode.OK:
        if header.size > TAIL_LIMIT:
            raise FrameError(f"{source}: a refusal of {header.size} bytes")
        reason = b"".join(_receive(sock, header, deadline, "a refusal"))
        raise CallError(status, reason.decode(errors="replace"))
    return _receive(sock, header, deadline, f"{source}'s answer")


def _failure(error: OSError, source: str) -> CallError:
    code = (
        grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(error, TimeoutError) else grpc.StatusCode.UNAVAILABLE
    )
    return CallError(code, f"{source}: {error}")


class TensorCall(Generic[Response]):
    """Calls method number ``code`` on ``port``, as the :class:`~edl_argo.rpc.chunked.ChunkedCall`
    ``fallback`` does over gRPC (and with it when the tensor port is not to be used): ``call(request,
    timeout)`` returns ``parse`` of the answer, or raises a ``grpc.RpcError``."""

    def __init__(
        self,
        port: TensorPort,
        code: int,
        parse: Callable[[Rope], Response],
        fallback: ChunkedCall[Response],
    ) -> None:
        self._port = port
        self._code = code
        self._parse = parse
        self._fallback = fallback

    def __call__(self, request: bytes | Encoding | Message, timeout: float) -> Response:
        deadline = time.monotonic() + timeout
        sock = self._port.connection(deadline)
        if sock is None:
            return self._fallback(request, timeout)
        try:
            send_parts(sock, _frame(REQUEST, self._code, _parts(request)), deadline)
        except OSError as error:
            sock.close()
            raise _failure(error, self._port.name) from None
        return self.answer(sock, deadline)

    def answer(self, sock: socket.socket, deadline: float) -> Response:
        """Read the answer of the call whose request ``sock`` carried, and keep or close ``sock``."""
        try:
            parts = _read_answer(sock, deadline, f"{self._port.name}'s tensor port")
        except CallError:
            self._port.release(sock)  # the server answered in full: the connection goes on
            raise
        except OSError as error:
            sock.close()
            raise _failure(error, self._port.name) from None
        self._port.release(sock)
        try:
            return self._parse(Rope(parts))
        except (IncompleteMessageError, ValueError, DecodeError) as error:  # ValueError: WireError, ...
            raise CallError(grpc.StatusCode.INTERNAL, f"{self._port.name}: {error}") from None

    def start(
        self, body: bytes | Encoding, timeout: float
    ) -> PendingCall[Response] | PendingTensorCall[Response]:
        """Send the serialized request ``body`` now and its last bytes later, as
        :meth:`ChunkedCall.start <edl_argo.rpc.chunked.ChunkedCall.start>`."""
        deadline = time.monotonic() + timeout
        sock = self._port.connection(deadline)
        if sock is None:
            return self._fallback.start(body, timeout)
        return PendingTensorCall(self, sock, body, deadline)


class PendingTensorCall(Generic[Response]):
    """A tensor port call whose request is sent (on a thread of its own) but for its tail, which
    :meth:`finish` sends, or which :meth:`cancel` never sends: the server reads no request without it."""

    def __init__(
        self, call: TensorCall[Response], sock: socket.socket, body: bytes | Encoding, deadline: float
    ) -> None:
        self._call = call
        self._sock = sock
        self._deadline = deadline
        self._sent: Future[None] = Future()
        self._finished = False
        self._sender = threading.Thread(
            target=self._send, args=(_frame(REQUEST, call._code, _parts(body), MORE),), daemon=True
        )
        self._sender.start()

    def _send(self, parts: list[Any]) -> None:
        try:
            send_parts(self._sock, parts, self._deadline)
        except BaseException as error:
            self._sent.set_exception(error)
        else:
            self._sent.set_result(None)

    def finish(self, tail: bytes) -> Response:
        """Send the request's last bytes and return the parsed answer (errors as :class:`TensorCall`'s)."""
        try:
            # Python 3.11: a Future's TimeoutError is the builtin one, an OSError.
            self._sent.result(timeout=max(0.0, self._deadline - time.monotonic()))
            send_parts(self._sock, _frame(TAIL, self._call._code, [tail]), self._deadline)
        except OSError as error:
            self.cancel()
            raise _failure(error, self._call._port.name) from None
        self._finished = True
        return self._call.answer(self._sock, self._deadline)

    def cancel(self) -> None:
        """Cancel the call before its request ends: the connection closes without its tail. Nothing once
        :meth:`finish` has sent the tail."""
        if self._finished:
            return
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sender.join(max(0.0, self._deadline - time.monotonic()))
        self._sock.close()
