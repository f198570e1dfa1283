"""The collective's wire: framed messages over plain TCP between the members of an AllreduceStrategy group.

Every member listens on one port (:class:`FrameServer`; in Kubernetes the container port named ``grpc``,
the one the job's NetworkPolicy opens). A frame is a fixed header (:data:`HEADER`, little-endian) and a
payload of ``payload_bytes``:

=========  ==========  =================================================================================
offset     field       meaning
=========  ==========  =================================================================================
0          magic       ``b"EDLC"``
4          version     :data:`PROTOCOL_VERSION`
5          kind        :class:`FrameKind`
6          dtype code  a piece's element type (:data:`PIECE_DTYPES`; 0 for other kinds)
7          flags       :data:`FLAG_FOUND` on a state response that carries a state
8          round_id    membership round (int64)
16         operation   collective operation within the round (int64)
24         step        ring step within the operation (int32)
28         sender      rank of the sending member (int32)
32         length      payload bytes (uint64), at most :func:`max_payload_bytes`
=========  ==========  =================================================================================

Kinds:

* ``PIECE`` (one-way, member to its right neighbour): a 1-D array of ``length / itemsize`` elements. The
  receiver reads it into a numpy array as its bytes arrive (``recv_into``; the array grows, at most to twice
  what arrived, so a declared length that never comes costs nothing) within :data:`PIECE_READ_SECONDS`, and
  hands it to its mailbox; the sender's bytes leave from the array's own memory.
* ``STATE_REQUEST`` (no payload) -> ``STATE_RESPONSE``: the state the member serves for ``round_id``
  (``round_id < 0``: its current state), with :data:`FLAG_FOUND`; without the flag and with no payload
  when it has none for that round (yet). A state is streamed (:func:`state_frames`): the response's payload
  is its manifest (an ``edl_argo.ModelState`` message naming each variable's dtype and shape, the version
  and the lineage), then each variable's bytes follow in ``STATE_DATA`` frames of at most the cap each. So
  no state is too large to travel, and the receiver reads the bytes straight into the arrays it keeps.
  A group's checkpoint is the same frames (:func:`encode_state`).

The cap on a frame's payload (:func:`max_payload_bytes`) is the project's message limit, 256 MiB; the
environment variable :data:`FRAME_CAP_ENV` lowers it (the tests use a few kilobytes). Every member of a job
must use the same cap (the master passes its own to every worker pod): a ring piece, which is at most the
cap on the sending side (:mod:`~edl_argo.collective.group` cuts larger vectors into blocks), is refused by a
receiver with a smaller one.

A frame this side cannot accept (wrong magic or version, unknown kind or dtype, a payload over the cap or not
a whole number of elements) closes its connection: the server logs ``collective_frame_rejected`` naming the
peer and the reason and goes on serving every other connection. The server bounds what its peers hold: a
connection that sends no frame for :data:`IDLE_SECONDS` is closed, and beyond :data:`MAX_CONNECTIONS` open
connections a new one closes the one idle longest (``collective_connection_evicted``).

**Authentication.** Every connection opens with a preamble, :data:`AUTH_MAGIC` and the job's collective
token (:func:`edl_argo.rpc.auth.JobSecret.collective_token`, 32 bytes; zeros from a process without one).
A server with a token (every worker of a job: :data:`~edl_argo.rpc.auth.COLLECTIVE_ENV`) reads the preamble
within :data:`AUTH_SECONDS` and compares it in constant time before it reads a frame or serves a state; a
connection without it, or with another job's, is closed, logged once per peer host
(``collective_unauthenticated``).

Outgoing pieces travel on one persistent connection per peer (:class:`PeerConnection`), reused across rounds
and reopened after any error, with a sender thread of its own (a peer address that is not ``host:port``
fails every send to it, naming the address), so that a member sends to its right neighbour
while its server's reader thread drains its left one. State requests use a short-lived connection each
(:func:`request_state`).
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from google.protobuf.message import DecodeError

from edl_argo.addresses import AddressError, parse_host_port, split_host_port
from edl_argo.collective.state import GroupState, Lineage
from edl_argo.log import get_logger
from edl_argo.proto import collective_pb2, tensor_pb2
from edl_argo.rpc.auth import TOKEN_BYTES, PeersLogged, collective_token_from_env
from edl_argo.rpc.channel import MAX_MESSAGE_BYTES
from edl_argo.rpc.sockets import (
    STOP_JOIN_SECONDS,
    SocketServer,
    connect,
    peer_host,
    recv_exact,
    recv_exact_into,
    send_parts,
)

log = get_logger(__name__)

MAGIC = b"EDLC"
PROTOCOL_VERSION = 2
#: magic, version, kind, dtype code, flags, round_id, operation, step, sender rank, payload bytes.
HEADER = struct.Struct("<4sBBBBqqiiQ")
#: Largest payload a frame may announce by default (the project's message limit, as for gRPC messages).
MAX_PAYLOAD_BYTES = MAX_MESSAGE_BYTES
#: Environment variable that sets a smaller cap (bytes) for every frame this process sends or accepts.
FRAME_CAP_ENV = "EDL_ARGO_COLLECTIVE_FRAME_BYTES"
#: Element types a piece may carry; a piece's dtype code is its index here plus one.
PIECE_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name).newbyteorder("<") for name in ("float32", "float64", "float16", "int32", "int64")
)
#: A state response carries a state.
FLAG_FOUND = 1
#: How long a member serving a state waits for the requester to take each frame of it.
STATE_FRAME_SECONDS = 60.0
#: How long the payload of a piece may take to arrive once its header did.
PIECE_READ_SECONDS = 120.0
#: A connection that sends no frame this long is closed (a member reconnects when it sends again).
IDLE_SECONDS = 600.0
#: Open connections a member's server keeps at most; one more closes the connection idle longest.
MAX_CONNECTIONS = 256
#: A piece is read into an array of at most this many bytes first, which then doubles as bytes arrive.
FIRST_READ_BYTES = 1 << 20

#: The first bytes of every connection, then the collective token (:data:`TOKEN_BYTES`).
AUTH_MAGIC = b"EDLA"
#: How long a server waits for a new connection's preamble.
AUTH_SECONDS = 10.0

#: ``(round_id, operation, step)``: where a piece belongs.
PieceKey = tuple[int, int, int]

#: ``state_provider(round_id)``: the state served for that round (``round_id < 0``: the current state), or
#: None if there is none (yet).
StateProvider = Callable[[int], GroupState | None]


def max_payload_bytes() -> int:
    """The cap on a frame's payload: :data:`FRAME_CAP_ENV` if set (a positive integer), else
    :data:`MAX_PAYLOAD_BYTES`."""
    configured = os.environ.get(FRAME_CAP_ENV, "")
    if not configured:
        return MAX_PAYLOAD_BYTES
    try:
        cap = int(configured)
    except ValueError:
        cap = 0
    if cap < 16:
        raise ValueError(f"{FRAME_CAP_ENV}={configured!r}: give a number of bytes of at least 16")
    return min(cap, MAX_PAYLOAD_BYTES)


class FrameKind(enum.IntEnum):
    PIECE = 1
    STATE_REQUEST = 2
    STATE_RESPONSE = 3
    STATE_DATA = 4


class FrameError(ConnectionError):
    """A frame that does not follow the protocol; its connection is closed."""


@dataclass(frozen=True)
class FrameHeader:
    """A frame's header fields after the magic and the version, in wire order."""

    kind: int
    dtype_code: int = 0
    flags: int = 0
    round_id: int = 0
    operation: int = 0
    step: int = 0
    sender_rank: int = 0
    payload_bytes: int = 0

    @property
    def key(self) -> PieceKey:
        return (self.round_id, self.operation, self.step)

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            PROTOCOL_VERSION,
            self.kind,
            self.dtype_code,
            self.flags,
            self.round_id,
            self.operation,
            self.step,
            self.sender_rank,
            self.payload_bytes,
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray) -> FrameHeader:
        """The header in ``data``; raises :class:`FrameError` for a wrong magic or version, or an oversized
        payload (the kind and dtype are the reader's to check)."""
        magic, version, *fields = HEADER.unpack(data)
        header = cls(*fields)
        if magic != MAGIC:
            raise FrameError(f"bad magic {magic!r}")
        if version != PROTOCOL_VERSION:
            raise FrameError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
        cap = max_payload_bytes()
        if header.payload_bytes > cap:
            raise FrameError(f"payload of {header.payload_bytes} bytes exceeds the cap of {cap}")
        return header


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (IPv6 hosts possibly in brackets) as ``(host, port)``."""
    return split_host_port(address)


def read_header(sock: socket.socket, deadline: float | None = None) -> FrameHeader | None:
    """The next frame's header; None when the peer closed the connection between frames."""
    data = bytearray(HEADER.size)
    if recv_exact_into(sock, memoryview(data), deadline) == 0:
        return None
    return FrameHeader.unpack(data)


def _piece_dtype(code: int) -> np.dtype:
    if not 1 <= code <= len(PIECE_DTYPES):
        raise FrameError(f"unknown dtype code {code}")
    return PIECE_DTYPES[code - 1]


def _piece_code(dtype: np.dtype) -> int:
    for code, wire in enumerate(PIECE_DTYPES, start=1):
        if dtype.newbyteorder("<") == wire:
            return code
    raise TypeError(f"a collective piece cannot carry dtype {dtype}")


def read_piece(sock: socket.socket, header: FrameHeader, deadline: float | None = None) -> np.ndarray:
    """The payload of a PIECE frame as an array of the header's dtype, all of it before ``deadline``
    (TimeoutError otherwise). Read as it arrives: the array starts at :data:`FIRST_READ_BYTES` at most and
    doubles while bytes keep coming, so it never holds more than twice what the peer actually sent."""
    dtype = _piece_dtype(header.dtype_code)
    total = header.payload_bytes
    if total % dtype.itemsize:
        raise FrameError(f"payload of {total} bytes is not a whole number of {dtype.name}")
    data = np.empty(min(total, FIRST_READ_BYTES), dtype=np.uint8)
    filled = 0
    while True:
        if len(data) > filled:
            recv_exact(sock, memoryview(data)[filled:], deadline, "a payload")
            filled = len(data)
        if filled == total:
            return data.view(dtype)
        grown = np.empty(min(total, 2 * len(data)), dtype=np.uint8)
        grown[:filled] = data
        data = grown


def _preamble(token: bytes | None) -> bytes:
    return AUTH_MAGIC + (token if token is not None else bytes(TOKEN_BYTES))


def _connect(address: str | tuple[str, int], deadline: float, token: bytes | None) -> socket.socket:
    """A connection to ``address`` that has sent its preamble with ``token``."""
    target = split_address(address) if isinstance(address, str) else address
    sock = connect(target, deadline)
    try:
        send_parts(sock, [_preamble(token)], deadline)
    except BaseException:
        sock.close()
        raise
    return sock


def _authenticated(sock: socket.socket, token: bytes | None) -> str:
    """Read a new connection's preamble; the reason to refuse it, or "" to serve it (always "" without a
    ``token``: a server of no job)."""
    data = bytearray(len(AUTH_MAGIC) + TOKEN_BYTES)
    try:
        got = recv_exact_into(sock, memoryview(data), time.monotonic() + AUTH_SECONDS)
    except TimeoutError:
        return f"no preamble within {AUTH_SECONDS:.0f} s"
    except ConnectionError:
        return "a short preamble"
    if got == 0 or not data.startswith(AUTH_MAGIC):
        return "no preamble"
    if token is not None and not hmac.compare_digest(bytes(data[len(AUTH_MAGIC) :]), token):
        return "a wrong collective token"
    return ""


# ------------------------------------------------------------------------------------------------ server


class FrameServer:
    """Serves the frames of every member that connects to ``listener``, until :meth:`stop`.

    One reader thread per connection (:class:`~edl_argo.rpc.sockets.SocketServer`, at most
    :data:`MAX_CONNECTIONS`) hands pieces to ``on_piece(key, array)`` and answers state requests from
    ``state_provider``.
    """

    def __init__(
        self,
        listener: socket.socket,
        on_piece: Callable[[PieceKey, np.ndarray], None],
        state_provider: StateProvider,
        token: bytes | None = None,
    ) -> None:
        """``token``: the collective token every connection must present (default: this process's,
        :func:`~edl_argo.rpc.auth.collective_token_from_env`; without one, any connection is served)."""
        self._token = token if token is not None else collective_token_from_env()
        self._refused_peers = PeersLogged()
        self._on_piece = on_piece
        self._state_provider = state_provider
        self._server = SocketServer(listener, self._serve, "collective", MAX_CONNECTIONS)
        self.port: int = self._server.port

    def _refused(self, peer: str, reason: str) -> None:
        host = peer_host(peer)
        if self._refused_peers.first(host):
            log.warning("collective_unauthenticated", port=self.port, peer=host, reason=reason)

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            refusal = _authenticated(sock, self._token)
            if refusal:
                self._refused(peer, refusal)
                return
            sock.settimeout(None)
            while (header := read_header(sock, time.monotonic() + IDLE_SECONDS)) is not None:
                if header.kind == FrameKind.PIECE:
                    piece = read_piece(sock, header, time.monotonic() + PIECE_READ_SECONDS)
                    self._on_piece(header.key, piece)
                elif header.kind == FrameKind.STATE_REQUEST:
                    if header.payload_bytes:
                        raise FrameError(f"state request with a payload of {header.payload_bytes} bytes")
                    self._answer_state(sock, header.round_id)
                else:
                    raise FrameError(f"unexpected frame kind {header.kind}")
                self._server.touch(sock)
        except FrameError as error:
            log.warning("collective_frame_rejected", peer=peer, reason=str(error))
        except OSError as error:
            if not self._server.stopping:
                log.debug("collective_connection_lost", peer=peer, error=str(error))

    def _answer_state(self, sock: socket.socket, round_id: int) -> None:
        state = self._state_provider(round_id)
        for part in state_frames(state, round_id):
            send_parts(sock, [part], time.monotonic() + STATE_FRAME_SECONDS)
            self._server.touch(sock)

    def stop(self) -> None:
        """Stop accepting, close every connection, and join the threads."""
        self._server.stop()


# ------------------------------------------------------------------------------------------------ client


@dataclass(frozen=True)
class _Send:
    """One queued frame: its header, its payload, and where to report the outcome."""

    header: bytes
    payload: memoryview
    deadline: float
    done: Future[None]


class PeerConnection:
    """The persistent connection to one member's :class:`FrameServer` that pieces travel on.

    Sends run on this connection's own thread, in the order they were asked for. The connection opens on
    the first send and reopens on the next send after any error, or when the peer closed it meanwhile (a
    member that died between two sends is then noticed by the reconnection's refusal, not by a timeout).
    """

    def __init__(self, address: str, token: bytes | None = None) -> None:
        """``token``: the collective token to present (default: this process's)."""
        self.address = address
        self._token = token if token is not None else collective_token_from_env()
        self._target: tuple[str, int] | None = None
        self._address_error = ""
        try:
            self._target = parse_host_port(address)
        except AddressError as error:
            self._address_error = str(error)
        self._queue: queue.SimpleQueue[_Send | None] = queue.SimpleQueue()
        self._sock: socket.socket | None = None
        self._closed = False
        self._lock = threading.Lock()  # guards _sock's replacement, _closed and queueing after close
        self._sender = threading.Thread(target=self._run, name=f"collective-send-{address}", daemon=True)
        self._sender.start()

    def send_piece(self, key: PieceKey, sender_rank: int, piece: np.ndarray, timeout: float) -> Future[None]:
        """Send ``piece`` (1-D) as the PIECE frame ``key``; the future completes when every byte is handed to
        the network, or fails with the OSError that stopped it (TimeoutError after ``timeout`` seconds,
        counted from now; ConnectionError at once after :meth:`close`). ``piece`` must not change until then:
        its own memory is sent."""
        code = _piece_code(piece.dtype)
        wire = np.ascontiguousarray(piece.reshape(-1), dtype=PIECE_DTYPES[code - 1])
        header = FrameHeader(
            FrameKind.PIECE,
            dtype_code=code,
            round_id=key[0],
            operation=key[1],
            step=key[2],
            sender_rank=sender_rank,
            payload_bytes=wire.nbytes,
        )
        done: Future[None] = Future()
        with self._lock:
            if self._closed:
                done.set_exception(ConnectionError(f"the connection to {self.address} is closed"))
            else:
                self._queue.put(
                    _Send(header.pack(), memoryview(wire.view(np.uint8)), time.monotonic() + timeout, done)
                )
        return done

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if not item.done.set_running_or_notify_cancel():
                continue
            try:
                if self._closed:
                    raise ConnectionError(f"the connection to {self.address} is closed")
                send_parts(self._connected(item.deadline), [item.header, item.payload], item.deadline)
            except OSError as error:
                self._disconnect()
                item.done.set_exception(error)
            except Exception as error:  # the thread must live on, and every future complete
                self._disconnect()
                item.done.set_exception(ConnectionError(f"cannot send to {self.address[:80]!r}: {error}"))
            else:
                item.done.set_result(None)
        self._disconnect()

    def _connected(self, deadline: float) -> socket.socket:
        """The open connection (a new one if there is none or the peer closed it)."""
        if self._sock is not None and select.select([self._sock], [], [], 0)[0]:
            # A piece connection never carries data back: readable means closed or reset by the peer.
            self._disconnect()
        if self._sock is None:
            if self._target is None:
                raise ConnectionError(self._address_error)
            sock = _connect(self._target, deadline, self._token)
            with self._lock:
                self._sock = sock
        return self._sock

    def _disconnect(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Stop the sender thread; a send in progress fails, later ones fail at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
            if self._sock is not None:
                with contextlib.suppress(OSError):  # the peer already closed it
                    self._sock.shutdown(socket.SHUT_RDWR)
        self._sender.join(STOP_JOIN_SECONDS)


class PeerConnections:
    """:class:`PeerConnection` by address, kept across rounds (members usually stay). Thread-safe."""

    def __init__(self) -> None:
        self._connections: dict[str, PeerConnection] = {}
        self._lock = threading.Lock()

    def connection(self, address: str) -> PeerConnection:
        with self._lock:
            if address not in self._connections:
                self._connections[address] = PeerConnection(address)
            return self._connections[address]

    def retain(self, addresses: Collection[str]) -> None:
        """Close the connections to every address not in ``addresses`` (members that left the group)."""
        with self._lock:
            gone = [self._connections.pop(a) for a in list(self._connections) if a not in addresses]
        for connection in gone:
            connection.close()

    def close(self) -> None:
        self.retain(())


def request_state(
    address: str, round_id: int, timeout: float, token: bytes | None = None
) -> GroupState | None:
    """The state the member at ``address`` serves for ``round_id`` (``< 0``: its current state), or None if
    it has none for that round; over a connection of its own. Each frame must arrive within ``timeout``
    seconds (a large state takes as many frames as it needs).

    Raises OSError when the member cannot be reached, does not answer in time, or answers with something
    other than a state (:class:`FrameError`). ``token``: the collective token to present (default: this
    process's).
    """
    token = token if token is not None else collective_token_from_env()
    with _connect(address, time.monotonic() + timeout, token) as sock:
        send_parts(
            sock, [FrameHeader(FrameKind.STATE_REQUEST, round_id=round_id).pack()], time.monotonic() + timeout
        )
        return read_state(_SocketFrames(sock, address, timeout), f"the state from {address}")


# ------------------------------------------------------------------------------------------------ states


class FrameSource(Protocol):
    """Where :func:`read_state` reads frames from: a connection, or a checkpoint's bytes."""

    def header(self) -> FrameHeader:
        """The next frame's header (OSError if there is none)."""

    def payload(self, into: memoryview) -> None:
        """Fill ``into`` with the payload of the frame whose header was read last."""


class _SocketFrames:
    def __init__(self, sock: socket.socket, address: str, timeout: float) -> None:
        self._sock = sock
        self._address = address
        self._timeout = timeout
        self._deadline = 0.0

    def header(self) -> FrameHeader:
        self._deadline = time.monotonic() + self._timeout  # each frame in its own time
        header = read_header(self._sock, self._deadline)
        if header is None:
            raise ConnectionError(f"{self._address} closed the connection without a whole state")
        return header

    def payload(self, into: memoryview) -> None:
        recv_exact(self._sock, into, self._deadline, "a payload")


class BufferFrames:
    """The frames in ``data`` (a checkpoint), read without copying them."""

    def __init__(self, data: bytes | memoryview, source: str) -> None:
        self._data = memoryview(data)
        self._offset = 0
        self._source = source

    def header(self) -> FrameHeader:
        if self._offset + HEADER.size > len(self._data):
            raise FrameError(f"{self._source} ends in the middle of a state")
        header = FrameHeader.unpack(self._data[self._offset : self._offset + HEADER.size])
        self._offset += HEADER.size
        return header

    def payload(self, into: memoryview) -> None:
        end = self._offset + len(into)
        if end > len(self._data):
            raise FrameError(f"{self._source} ends in the middle of a state")
        into[:] = self._data[self._offset : end]
        self._offset = end

    @property
    def exhausted(self) -> bool:
        return self._offset == len(self._data)


def _little_endian(value: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(value)
    return array.astype(array.dtype.newbyteorder("<")) if array.dtype.byteorder == ">" else array


def state_frames(state: GroupState | None, round_id: int) -> Iterator[bytes | memoryview]:
    """The frames of a state response: a ``STATE_RESPONSE`` header and the manifest, then each variable's
    bytes as ``STATE_DATA`` frames of at most :func:`max_payload_bytes` each (a header, then its payload as a
    view of the variable's own memory). ``state`` None: a response without a state."""
    if state is None:
        yield FrameHeader(FrameKind.STATE_RESPONSE, round_id=round_id).pack()
        return
    manifest = collective_pb2.ModelState(
        round_id=state.round_id,
        version=state.version,
        variables=[
            tensor_pb2.Tensor(name=str(i), dtype=_little_endian(v).dtype.str, shape=v.shape)
            for i, v in enumerate(state.values)
        ],
        lineage_rounds=[r for r, _ in state.lineage.spans],
        lineage_versions=[v for _, v in state.lineage.spans],
    ).SerializeToString()
    cap = max_payload_bytes()
    if len(manifest) > cap:
        raise FrameError(f"a state's manifest of {len(manifest)} bytes exceeds the frame cap of {cap}")
    yield FrameHeader(
        FrameKind.STATE_RESPONSE, round_id=round_id, flags=FLAG_FOUND, payload_bytes=len(manifest)
    ).pack()
    yield manifest
    for value in state.values:
        data = memoryview(_little_endian(value).reshape(-1).view(np.uint8))
        for start in range(0, len(data), cap):
            chunk = data[start : start + cap]
            yield FrameHeader(FrameKind.STATE_DATA, round_id=round_id, payload_bytes=len(chunk)).pack()
            yield chunk


def encode_state(state: GroupState) -> bytes:
    """The state as the bytes of its frames (a checkpoint; :func:`read_state` of :class:`BufferFrames`)."""
    return b"".join(state_frames(state, state.round_id))


def read_state(frames: FrameSource, source: str) -> GroupState | None:
    """The state :func:`state_frames` sent, each variable read straight into a new array; None for a
    response without a state. :class:`FrameError` naming ``source`` for anything else."""
    header = frames.header()
    if header.kind != FrameKind.STATE_RESPONSE:
        raise FrameError(f"{source}: a frame of kind {header.kind} where a state response belongs")
    if not header.flags & FLAG_FOUND:
        if header.payload_bytes:
            raise FrameError(f"{source}: a response without a state has a payload")
        return None
    manifest_bytes = bytearray(header.payload_bytes)
    frames.payload(memoryview(manifest_bytes))
    try:
        manifest = collective_pb2.ModelState.FromString(bytes(manifest_bytes))
        values = [_empty_array(tensor) for tensor in manifest.variables]
        if len(manifest.lineage_rounds) != len(manifest.lineage_versions):
            raise ValueError(
                f"its lineage has {len(manifest.lineage_rounds)} rounds"
                f" but {len(manifest.lineage_versions)} versions"
            )
    except (DecodeError, TypeError, ValueError, MemoryError) as error:
        raise FrameError(f"{source}: an undecodable state manifest: {error}") from None
    for value in values:
        view = memoryview(value.reshape(-1).view(np.uint8))
        filled = 0
        while filled < len(view):
            header = frames.header()
            if header.kind != FrameKind.STATE_DATA or not 0 < header.payload_bytes <= len(view) - filled:
                raise FrameError(
                    f"{source}: a frame of kind {header.kind} and {header.payload_bytes} bytes where "
                    f"{len(view) - filled} bytes of a variable belong"
                )
            frames.payload(view[filled : filled + header.payload_bytes])
            filled += header.payload_bytes
    lineage = Lineage(tuple(zip(manifest.lineage_rounds, manifest.lineage_versions, strict=True)))
    return GroupState(manifest.round_id, manifest.version, values, lineage)


def _empty_array(tensor: tensor_pb2.Tensor) -> np.ndarray:
    dtype = np.dtype(tensor.dtype)
    if dtype.kind not in "biuf" or dtype.byteorder == ">":
        raise ValueError(f"variable {tensor.name}: dtype {tensor.dtype} cannot be part of a state")
    if any(d < 0 for d in tensor.shape):
        raise ValueError(f"variable {tensor.name}: negative dimension in {list(tensor.shape)}")
    return np.empty(tuple(tensor.shape), dtype=dtype)
