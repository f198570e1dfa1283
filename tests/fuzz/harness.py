"""Send fuzzed requests to live gRPC servers for a time budget and classify every answer.

An answer is fine when it is OK or a refusal a server gives on purpose (INVALID_ARGUMENT,
FAILED_PRECONDITION, RESOURCE_EXHAUSTED, ...). It is a *crash* when the server answers INTERNAL or UNKNOWN
(an exception escaped a handler) or is gone while its job still runs, and a *hang* when a call passes its
deadline. :class:`FuzzReport` counts them and keeps the first few of each with the method and the server's
message.

UNAVAILABLE alone does not tell a gone server from a dropped connection: a client drops a connection whose
HTTP/2 ping is unanswered for 5 s (:mod:`edl_argo.rpc.channel`), which a server paused or starved of CPU
that long causes, and fails the calls on it UNAVAILABLE (a real worker retries them). So after an
UNAVAILABLE the fuzzer waits up to :data:`RECONNECT_SECONDS` for the server to accept a connection again:
if it does, the call counts as a dropped connection (``FuzzReport.dropped``), not a crash; if ``stop`` is
set meanwhile (the job ended and stopped its servers) the run ends; otherwise the server is gone: a crash.
A server that died and was started again by its job also answers again: the caller checks that its job
replaced no server (the job's ``relaunches``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from edl_argo.addresses import parse_host_port
from edl_argo.proto import ps_pb2
from edl_argo.rpc import tensor_port
from edl_argo.rpc.auth import IDENTITY_KEY, TOKEN_KEY
from edl_argo.rpc.chunked import CHUNK_BYTES, CallError, cut
from edl_argo.rpc.ps_layout import TENSOR_PORT_METHODS
from edl_argo.rpc.sockets import connect, send_parts
from tests.fuzz.messages import MessageFuzzer

#: Codes a server gives on purpose to a request it refuses.
REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.ABORTED,
    }
)
CRASHES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
#: Share of requests sent as randomly edited bytes of a valid message instead of the message.
MUTATED_SHARE = 0.2
#: How long a server that answered UNAVAILABLE has to accept a connection again before it counts as gone:
#: the calls' deadline, and as long as a job lets a PS leave its pings unanswered before replacing it.
RECONNECT_SECONDS = 30.0


@dataclass(frozen=True)
class Method:
    """One gRPC method to fuzz: its full path, its request type, and ``adjust(request, fuzzer)``, which
    may change a generated request (to keep it from doing what a real peer may legitimately do, or from a
    known gap another change closes)."""

    path: str
    request: type[Message]
    adjust: Callable[[Message, MessageFuzzer], None] | None = None
    #: Whether to send randomly edited bytes too (:data:`MUTATED_SHARE` of the requests).
    mutate: bool = True
    #: Whether the method is a streaming twin (:mod:`edl_argo.rpc.chunked`): the request's bytes go as
    #: ``Chunk`` messages of a random size, and the answer's chunks are read to the end.
    chunked: bool = False
    #: Whether the method is served on the PS's tensor port (:mod:`edl_argo.rpc.tensor_port`; ``path`` is
    #: ``tensor-port/<method>``): each call opens a connection with the call's credential in its hello
    #: and sends the request's bytes in pieces of random sizes.
    tensor_port: bool = False


@dataclass
class FuzzReport:
    requests: int = 0
    by_method: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    #: Calls that ended UNAVAILABLE on a connection dropped while the server stayed up (module docstring),
    #: with the seconds into the run and how long the server took to accept a connection again.
    dropped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def record(
        self,
        method: str,
        code: grpc.StatusCode,
        details: str,
        elapsed: float,
        timeout: float,
        gone: bool = False,
    ) -> None:
        """Count one answer; ``gone``: the server answered UNAVAILABLE and no connection since."""
        self.requests += 1
        self.by_method[method] += 1
        self.codes[code.name] += 1
        if code in CRASHES or gone:
            self.crashes.append(f"{method}: {code.name}{' (server gone)' if gone else ''} {details[:300]}")
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED or elapsed >= timeout:
            self.hangs.append(f"{method}: no answer within {timeout} s")

    def merge(self, other: FuzzReport) -> None:
        self.requests += other.requests
        self.by_method.update(other.by_method)
        self.codes.update(other.codes)
        self.crashes += other.crashes
        self.hangs += other.hangs
        self.dropped += other.dropped


def fuzz(
    channel: grpc.Channel,
    methods: Sequence[Method],
    seed: int,
    seconds: float,
    max_requests: int,
    names: Sequence[str] = (),
    stop: threading.Event | None = None,
    timeout: float = 30.0,
    metadata: Callable[[Message], Sequence[tuple[str, str]]] | None = None,
    enough: Callable[[FuzzReport], bool] | None = None,
) -> FuzzReport:
    """Call random ``methods`` (each as often as the others) with random requests from ``seed`` until
    ``seconds`` pass, ``max_requests`` are sent, ``stop`` is set or the report is ``enough``; one call at a
    time, each with ``timeout`` and the ``metadata`` given for its request (a credential of the job,
    :mod:`edl_argo.rpc.auth`: the fuzzer is an insider)."""
    fuzzer = MessageFuzzer(seed, names)
    calls = {
        m.path: _tensor_port_call(channel, m.path, fuzzer)
        if m.tensor_port
        else _chunked_call(channel, m.path, fuzzer)
        if m.chunked
        else channel.unary_unary(m.path, request_serializer=None, response_deserializer=None)
        for m in methods
    }
    report = FuzzReport()
    started = time.monotonic()
    while report.requests < max_requests and time.monotonic() - started < seconds:
        if (stop is not None and stop.is_set()) or (enough is not None and enough(report)):
            break
        # A random method among those called least so far: every method is called as often as the others.
        least = min(report.by_method[m.path] for m in methods)
        method = fuzzer.rng.choice([m for m in methods if report.by_method[m.path] == least])
        request = fuzzer.message(method.request)
        if method.adjust is not None:
            method.adjust(request, fuzzer)
        data = request.SerializeToString()
        if method.mutate and fuzzer.rng.random() < MUTATED_SHARE:
            data = fuzzer.mutated(data)
        began = time.monotonic()
        try:
            calls[method.path](data, timeout=timeout, metadata=metadata(request) if metadata else None)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""  # type: ignore[attr-defined]
        elapsed = time.monotonic() - began
        gone = False
        if code == grpc.StatusCode.UNAVAILABLE:
            waited = _reconnect(channel, stop)
            if stop is not None and stop.is_set():
                break  # the job ended and stopped its servers (``stop`` may be set a moment after): no crash
            gone = waited is None
            if not gone:
                at = began - started
                report.dropped.append(
                    f"{method.path} at {at:.1f} s, back after {waited:.1f} s: {details[:200]}"
                )
        report.record(method.path, code, details, elapsed, timeout, gone)
    report.seconds = time.monotonic() - started
    return report


#: The chunk sizes a streaming twin's requests are cut into (bytes of the request per chunk).
CHUNK_SIZES = (1, 64, 4096, CHUNK_BYTES)
#: The most chunks a request is cut into: a large request in 1-byte chunks would take longer to send than
#: the server's request-arrival deadline, and each such call would spend the fuzzer's time on one cancel.
MAX_CHUNKS = 1024


def _chunked_call(channel: grpc.Channel, path: str, fuzzer: MessageFuzzer) -> Callable[..., list[bytes]]:
    """A call of the streaming twin ``path`` taking the request's bytes as a unary call does."""
    stream = channel.stream_stream(path)

    def call(data: bytes, timeout: float, metadata: Any) -> list[bytes]:
        chunks = cut(data, size=max(fuzzer.rng.choice(CHUNK_SIZES), -(-len(data) // MAX_CHUNKS)))
        return list(stream(chunks, timeout=timeout, metadata=metadata))

    return call


#: The path prefix of a method served on a PS's tensor port.
TENSOR_PORT_PREFIX = "tensor-port/"


def _tensor_port_call(channel: grpc.Channel, path: str, fuzzer: MessageFuzzer) -> Callable[..., None]:
    """A call of ``tensor-port/<method>`` on the tensor port of the PS ``channel`` leads to (its address
    asked of its GetStatus with the call's credential), taking the request's bytes as a unary call does and
    raising its refusal as a ``grpc.RpcError``."""
    number = TENSOR_PORT_METHODS.index(path.removeprefix(TENSOR_PORT_PREFIX)) + 1
    status = channel.unary_unary(
        "/edl_argo.ParameterServer/GetStatus",
        request_serializer=ps_pb2.GetStatusRequest.SerializeToString,
        response_deserializer=ps_pb2.ParameterServerStatus.FromString,
    )
    where: list[tuple[str, int]] = []

    def call(data: bytes, timeout: float, metadata: Any) -> None:
        deadline = time.monotonic() + timeout
        credential = dict(metadata or ())
        if not where:
            address = status(ps_pb2.GetStatusRequest(), timeout=timeout, metadata=metadata).tensor_port
            where.append(parse_host_port(address))
        size = max(fuzzer.rng.choice(CHUNK_SIZES), -(-len(data) // MAX_CHUNKS))
        pieces = [data[i : i + size] for i in range(0, len(data), size)]
        hello = tensor_port.hello(credential.get(IDENTITY_KEY, ""), credential.get(TOKEN_KEY, ""))
        try:
            with connect(where[0], deadline) as sock:
                send_parts(sock, [hello], deadline)
                tensor_port._read_answer(sock, deadline, "the hello")
                send_parts(sock, tensor_port._frame(tensor_port.REQUEST, number, pieces), deadline)
                tensor_port._read_answer(sock, deadline, path)
        except CallError:
            raise
        except OSError as error:
            raise tensor_port._failure(error, path) from None

    return call


def _reconnect(channel: grpc.Channel, stop: threading.Event | None) -> float | None:
    """Seconds until ``channel``'s server accepted a connection again (None: not within
    :data:`RECONNECT_SECONDS`, or ``stop`` was set first)."""
    began = time.monotonic()
    while time.monotonic() - began < RECONNECT_SECONDS and not (stop is not None and stop.is_set()):
        ready = grpc.channel_ready_future(channel)
        try:
            ready.result(timeout=1.0)
            return time.monotonic() - began
        except grpc.FutureTimeoutError:
            ready.cancel()
    return None


def rss_bytes(pid: int) -> int:
    """The resident set size of process ``pid`` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    state = next(
        (line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:")),
        "",
    )
    raise AssertionError(f"no VmRSS for process {pid} ({state})")


def pod_processes(pods_dir: Path, pod: str) -> list[int]:
    """The pids of the live processes of local pod ``pod`` (``ps-0``): its process group (its supervisor,
    its command and what that started), whose id the supervisor file of its folder under ``pods_dir``
    records. Works for pods started with exec and pods forked from the pod template alike (the latter's
    command lines are the template's)."""
    (record,) = pods_dir.glob(f"{pod}.*/supervisor")
    pgid = int(json.loads(record.read_text())["pgid"])
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    if not found:
        raise AssertionError(f"no process of {pod} runs (group {pgid})")
    return found
