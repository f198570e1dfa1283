"""A parameter server's tensor port (edl_argo.rpc.tensor_port): the push and the dense pull over plain TCP.

What it must do: carry the large messages instead of gRPC, with the gRPC method's answers; refuse callers of
another job, oversized or broken requests, and requests whose tail never comes, and go on serving; and let
a worker fall back to gRPC where there is no port to reach, with every call within its deadline.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import keras
import numpy as np
import pytest

from edl_argo.proto import ps_pb2
from edl_argo.ps.server import ServingPS, start_server
from edl_argo.ps.servicer import ParameterServerServicer
from edl_argo.rpc import tensor_port
from edl_argo.rpc.auth import JobSecret
from edl_argo.rpc.ps_layout import TENSOR_PORT_METHODS
from edl_argo.worker.ps_client import ParameterServerClient
from tests.tcp_proxy import SilentProxy

SECRET = JobSecret(b"t" * 32)
PUSH = TENSOR_PORT_METHODS.index("PushGradients") + 1
PULL = TENSOR_PORT_METHODS.index("PullDenseParameters") + 1
#: 4 MB of parameters: a push and its answer are each several times what GetStatus and PushModel move.
WEIGHTS = np.linspace(-1.0, 1.0, 1 << 20, dtype=np.float32).reshape(1024, 1024)


def servicer() -> ParameterServerServicer:
    return ParameterServerServicer(lambda: keras.optimizers.SGD(0.1), jit_compile=False)


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[ParameterServerServicer, str]]]:
    """Start a PS (a tensor port unless ``tensor_port=None``); returns its servicer and gRPC address."""
    started: list[ServingPS] = []

    def start(
        tensor_port: int | None = 0, secret: JobSecret | None = SECRET
    ) -> tuple[ParameterServerServicer, str]:
        ps = servicer()
        server, port = start_server(ps, "127.0.0.1", 0, secret, "ps-0", tensor_port=tensor_port)
        started.append(server)
        return ps, f"127.0.0.1:{port}"

    start.started = started  # type: ignore[attr-defined]
    yield start
    for server in started:
        server.stop(None)


def client(address: str, **kwargs: object) -> ParameterServerClient:
    return ParameterServerClient([address], credential=SECRET.credential("worker-0"), **kwargs)  # type: ignore[arg-type]


def train(ps_client: ParameterServerClient, steps: int) -> dict[str, np.ndarray]:
    """Offer the model, push ``steps`` gradients (the replies carrying the parameters), pull once more."""
    ps_client.push_model({"w": WEIGHTS}, [])
    _, versions, _ = ps_client.pull_dense([-1])
    for step in range(steps):
        result = ps_client.push_gradients({"w": WEIGHTS * (step + 1)}, {}, versions, return_parameters=True)
        assert result.accepted and result.parameters is not None
        versions = result.parameters[1]
    values, _, _ = ps_client.pull_dense([-1])
    return values


def hello(sock: socket.socket, identity: bytes, token: bytes) -> None:
    sock.sendall(tensor_port.hello(identity.decode(), token.decode()))


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """The status code and payload of the next response frame."""
    head = b""
    while len(head) < tensor_port.HEADER.size:
        got = sock.recv(tensor_port.HEADER.size - len(head))
        if not got:
            raise ConnectionError("closed")
        head += got
    magic, kind, code, _, _, pieces, size = tensor_port.HEADER.unpack(head)
    assert magic == tensor_port.FRAME_MAGIC and kind == tensor_port.RESPONSE
    payload = b""
    while len(payload) < 8 * pieces + size:
        payload += sock.recv(8 * pieces + size - len(payload))
    return code, payload[8 * pieces :]


def open_port(ps: ParameterServerServicer, identity: bytes = b"worker-0") -> socket.socket:
    """A connection to the PS's tensor port past its hello."""
    host, port = ps.tensor_port.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    hello(sock, identity, SECRET.token(identity.decode()).encode())
    assert read_response(sock) == (0, b"")
    return sock


def frame(kind: int, code: int, payload: bytes, flags: int = 0, declared: int | None = None) -> bytes:
    """A frame of one piece, ``payload``, which may claim ``declared`` bytes."""
    size = len(payload) if declared is None else declared
    pieces = 1 if size else 0
    header = tensor_port.HEADER.pack(tensor_port.FRAME_MAGIC, kind, code, flags, 0, pieces, size)
    return header + struct.pack(f"<{pieces}Q", *([size] if size else [])) + payload


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


def test_pushes_and_pulls_travel_on_the_tensor_port_with_the_answers_grpc_gives(serve: Callable) -> None:
    """Both ways train the same: and through a byte-counting proxy in front of gRPC, the port's PS moves a
    fraction of what the other does (its tensors went past gRPC)."""
    with_port, port_address = serve()
    without_port, plain_address = serve(tensor_port=None)
    assert with_port.tensor_port.startswith("127.0.0.1:") and without_port.tensor_port == ""
    proxies = [SilentProxy(port_address), SilentProxy(plain_address)]
    try:
        results = []
        for proxy in proxies:
            ps_client = client(proxy.address)
            results.append(train(ps_client, steps=3))
            ps_client.close()
        np.testing.assert_array_equal(results[0]["w"], results[1]["w"])
        assert not np.array_equal(results[0]["w"], WEIGHTS)  # three steps were applied
        over_grpc = [proxy.upstream_bytes for proxy in proxies]
        # The model offered (4 MB, PushModel) goes over gRPC either way; 3 pushes (12 MB) and a pull only
        # without the port.
        assert over_grpc[1] > 12 * WEIGHTS.nbytes // 4, over_grpc
        assert over_grpc[0] < 2 * WEIGHTS.nbytes, over_grpc
    finally:
        for proxy in proxies:
            proxy.close()
    assert with_port.version == without_port.version == 3


def test_a_caller_of_another_job_is_refused_at_its_hello(serve: Callable) -> None:
    ps, _ = serve()
    host, port = ps.tensor_port.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        hello(sock, b"worker-0", JobSecret(b"x" * 32).token("worker-0").encode())
        code, reason = read_response(sock)
        assert code == grpc.StatusCode.UNAUTHENTICATED.value[0], reason
        sock.sendall(
            frame(
                tensor_port.REQUEST, PULL, ps_pb2.PullDenseParametersRequest(version=-1).SerializeToString()
            )
        )
        assert closed_within(sock, 5)
    with open_port(ps) as sock:  # a caller of the job is served
        sock.sendall(
            frame(
                tensor_port.REQUEST, PULL, ps_pb2.PullDenseParametersRequest(version=-1).SerializeToString()
            )
        )
        code, payload = read_response(sock)
        assert code == 0 and not ps_pb2.PullDenseParametersResponse.FromString(payload).initialized


def test_hostile_frames_get_a_status_or_close_their_connection_and_the_port_serves_on(
    serve: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An oversized request is refused before its bytes are read; a request whose tail never comes is never
    applied; a request that stops arriving is dropped after the arrival time; bytes that break the protocol
    close the connection; mutated pushes get answers. After all of it, a real push is applied once."""
    ps, address = serve()
    ps_client = client(address)
    ps_client.push_model({"w": WEIGHTS}, [])
    push = ps_pb2.PushGradientsRequest(
        version=0, gradients=ps_pb2.Model(dense_parameters=[]), pusher_id="p", sequence=1
    ).SerializeToString()

    with open_port(ps) as sock:  # declares a byte more than the message limit
        sock.sendall(frame(tensor_port.REQUEST, PUSH, b"", declared=(256 << 20) + 1))
        code, reason = read_response(sock)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and b"more than" in reason
        assert closed_within(sock, 5)

    with open_port(ps) as sock:  # a tail that never comes: the connection closes, nothing applied
        sock.sendall(frame(tensor_port.REQUEST, PUSH, push, flags=tensor_port.MORE))
        sock.shutdown(socket.SHUT_WR)
        assert closed_within(sock, 5)
    assert ps.version == 0

    with open_port(ps) as sock:  # unknown method, wrong magic
        sock.sendall(frame(tensor_port.REQUEST, 99, b""))
        assert closed_within(sock, 5)
    with open_port(ps) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: ps\r\nAccept: */*\r\n\r\n")
        assert closed_within(sock, 5)

    with open_port(ps) as sock:  # declares 8 MB, sends 1 KB and stops: dropped after the arrival time
        sock.sendall(frame(tensor_port.REQUEST, PUSH, b"\0" * 1024, declared=8 << 20))
        assert not closed_within(sock, 1), "dropped before its arrival time"
        assert closed_within(sock, 15), "a stalled request was waited for past its arrival time"

    rng = random.Random(7)
    answered = 0
    for _ in range(100):
        mutated = bytearray(push)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        with open_port(ps) as sock:
            sock.sendall(frame(tensor_port.REQUEST, rng.choice((PUSH, PULL)), bytes(mutated)))
            try:
                read_response(sock)
                answered += 1
            except ConnectionError:
                pass
    assert answered >= 90, f"{answered} of 100 mutated requests were answered"
    before = ps.version
    _, versions, _ = ps_client.pull_dense([-1])
    result = ps_client.push_gradients({"w": WEIGHTS}, {}, versions)
    assert result.accepted and ps.version == before + 1
    ps_client.close()


def test_a_pending_push_is_applied_once_it_ends_and_never_when_cancelled(serve: Callable) -> None:
    ps, address = serve()
    ps_client = client(address)
    ps_client.push_model({"w": WEIGHTS}, [])
    from edl_argo.worker.ps_client import push_request

    def body(sequence: int) -> object:
        fields = ps_pb2.PushGradientsRequest(version=0, pusher_id="pending", sequence=sequence)
        return push_request(fields, {"w": WEIGHTS}, {}, {})

    call = ps_client._pushes[0]
    cancelled = call.start(body(1), timeout=10)
    assert isinstance(cancelled, tensor_port.PendingTensorCall)
    time.sleep(0.3)  # its body has arrived
    cancelled.cancel()
    pending = call.start(body(2), timeout=10)
    time.sleep(0.3)
    assert ps.version == 0, "a push was applied before its tail came"
    reply = pending.finish(ps_pb2.PushGradientsRequest(authority_step=0).SerializeToString())
    assert reply.accepted and ps.version == 1
    ps_client.close()


def test_without_a_port_to_reach_calls_go_over_grpc(serve: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PS that names an address nothing listens on: the first call falls back to gRPC at once (the
    connection is refused), says so once, and the calls after it do not try the port again for a while."""
    ps, address = serve()
    closed = socket.create_server(("127.0.0.1", 0))
    ps.tensor_port = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    warnings: list[dict] = []
    monkeypatch.setattr(
        tensor_port.log, "warning", lambda event, **fields: warnings.append({"event": event, **fields})
    )
    ps_client = client(address)
    started = time.monotonic()
    values = train(ps_client, steps=2)
    assert time.monotonic() - started < 20
    assert ps.version == 2 and values["w"].shape == WEIGHTS.shape
    assert [w["event"] for w in warnings] == ["ps_tensor_port_unreachable"], warnings
    ps_client.close()


def test_a_silent_tensor_port_costs_a_call_its_deadline_then_calls_go_over_grpc(
    serve: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path to the port that swallows everything (a partition): the call on the open connection fails at
    its deadline, the retry's new connection gets no answer to its hello within that deadline either, and the
    call goes over gRPC, which works."""
    ps, address = serve()
    proxy = SilentProxy(ps.tensor_port)
    ps.tensor_port = proxy.address  # what GetStatus names: the path through the proxy
    warnings: list[str] = []
    monkeypatch.setattr(tensor_port.log, "warning", lambda event, **_: warnings.append(event))
    try:
        ps_client = client(address, rpc_timeout_seconds=1.0, retry_budget_seconds=30)
        ps_client.push_model({"w": WEIGHTS}, [])
        assert ps_client.pull_dense([-1])[2]
        assert proxy.upstream_bytes > 0 and not warnings  # that pull went through the port
        proxy.go_silent()
        started = time.monotonic()
        values, _, initialized = ps_client.pull_dense([-1])
        took = time.monotonic() - started
        assert initialized and np.array_equal(values["w"], WEIGHTS)
        assert 1.0 <= took < 6.0, took
        assert warnings == ["ps_tensor_port_unreachable"]
        ps_client.close()
    finally:
        proxy.close()


def test_a_stopped_ps_closes_its_tensor_port() -> None:
    """Stopping a PS closes its tensor port with its gRPC port: an idle connection ends, a new one is
    refused (a worker then retries, as against a PS that died)."""
    ps = servicer()
    server, _ = start_server(ps, "127.0.0.1", 0, SECRET, "ps-0", tensor_port=0)
    host, port = ps.tensor_port.rsplit(":", 1)
    idle = open_port(ps)
    server.stop(None).wait(10)
    assert closed_within(idle, 5)
    idle.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()


def test_a_tensor_port_that_moved_is_found_again_at_once(
    serve: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relaunched PS serves its tensor port elsewhere (locally: another free port). The worker's next
    call finds the old one closed, asks the PS again and goes on over the new one: no detour over gRPC."""
    from edl_argo.ps.serving import ps_server_limits, start_tensor_port

    ps, address = serve()
    warnings: list[str] = []
    monkeypatch.setattr(tensor_port.log, "warning", lambda event, **_: warnings.append(event))
    ps_client = client(address)
    ps_client.push_model({"w": WEIGHTS}, [])
    _, versions, _ = ps_client.pull_dense([-1])
    old = ps.tensor_port
    moved = start_tensor_port(ps, "127.0.0.1", 0, SECRET, ps_server_limits(30.0))
    try:
        assert ps.tensor_port != old
        for server in serve.started:  # type: ignore[attr-defined]
            if server.tensor_port is not None and server.tensor_port.port == int(old.rsplit(":", 1)[1]):
                server.tensor_port.stop()
        result = ps_client.push_gradients({"w": WEIGHTS}, {}, versions)
        assert result.accepted and ps.version == 1 and not warnings, warnings
        (sock,) = ps_client._tensor_ports[0]._idle
        assert sock.getpeername()[1] == moved.port
    finally:
        moved.stop()
        ps_client.close()


def test_a_call_being_served_when_the_ps_stops_is_answered_within_the_grace() -> None:
    """A PS stopping (SIGTERM) lets the calls it is serving finish and answer, as gRPC's grace does: a push
    whose tail comes after the stop began is applied and answered; then the port is closed."""
    from edl_argo.worker.ps_client import push_request

    ps = servicer()
    server, port = start_server(ps, "127.0.0.1", 0, SECRET, "ps-0", tensor_port=0)
    ps_client = client(f"127.0.0.1:{port}")
    ps_client.push_model({"w": WEIGHTS}, [])
    fields = ps_pb2.PushGradientsRequest(version=0, pusher_id="stopping", sequence=1)
    pending = ps_client._pushes[0].start(push_request(fields, {"w": WEIGHTS}, {}, {}), timeout=10)
    time.sleep(0.3)  # the request is being read: a call being served
    stopper = threading.Thread(target=lambda: server.stop(5.0))
    stopper.start()
    time.sleep(0.3)
    assert stopper.is_alive(), "the stop did not wait for the call being served"
    reply = pending.finish(ps_pb2.PushGradientsRequest(authority_step=0).SerializeToString())
    assert reply.accepted and ps.version == 1
    stopper.join(10)
    assert not stopper.is_alive()
    host, tensor = ps.tensor_port.rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(tensor)), timeout=5).close()
    ps_client.close()


def test_a_request_whose_caller_gave_up_is_never_applied(
    serve: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller whose deadline passed (the PS was paused, say) closes its connection and sends the push
    again, perhaps to a replacement PS restored from a checkpoint. A paused PS that resumes finds the request
    and the close in its buffer: it must not apply the push (which the retry then applies a second time)."""
    resumed = threading.Event()  # the PS is "paused" before it reads a request's pieces until this is set
    receive = tensor_port._receive

    def paused_receive(*args: object) -> list[memoryview]:
        assert resumed.wait(10), "the test never resumed the PS"
        return receive(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(tensor_port, "_receive", paused_receive)
    ps, address = serve()
    ps_client = client(address)
    weights = WEIGHTS[:4]  # a request that fits in the socket's buffers, as the paused PS's did
    ps_client.push_model({"w": weights}, [])
    from edl_argo.worker.ps_client import push_request

    fields = ps_pb2.PushGradientsRequest(version=0, pusher_id="gave-up", sequence=1)
    body = b"".join(bytes(piece) for piece in push_request(fields, {"w": weights}, {}, {}).pieces)
    host, port = ps.tensor_port.rsplit(":", 1)
    greeting = tensor_port.hello("worker-0", SECRET.token("worker-0"))
    for gave_up in (True, False):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(greeting + frame(tensor_port.REQUEST, PUSH, body))
            if gave_up:
                sock.shutdown(socket.SHUT_WR)  # all of it sent, then the end: as a caller that gave up
                resumed.set()
                assert closed_within(sock, 10)
            else:
                assert read_response(sock) == (0, b"")  # the hello's answer
                code, _ = read_response(sock)
                assert code == 0
        assert ps.version == (0 if gave_up else 1), gave_up
    ps_client.close()
