"""Large messages as streams of chunks (edl_argo.rpc.chunked): the cut and the join are exact, bounded and
refuse what is no chunk; a server's streaming twin answers as its unary method does, refuses oversized,
malformed, late and unauthenticated requests; and a worker's pushes and pulls go through it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from edl_argo.proto import ps_pb2, ps_pb2_grpc
from edl_argo.ps.server import start_server
from edl_argo.rpc import ps_layout
from edl_argo.rpc.auth import JobSecret
from edl_argo.rpc.channel import MAX_MESSAGE_BYTES, make_channel, make_server
from edl_argo.rpc.chunked import (
    ChunkedCall,
    ChunkedMethod,
    IncompleteMessageError,
    MessageTooLargeError,
    chunked_service,
    cut,
    gather,
    message_of,
)
from edl_argo.rpc.ps_layout import CHUNKED_SERVICE
from edl_argo.rpc.tensors import from_tensor
from edl_argo.rpc.wire import Encoding, WireError
from edl_argo.worker.ps_client import ParameterServerClient
from tests.test_ps_service import B, W, model, pull_dense, push, servicer

pytestmark = pytest.mark.timeout(120)

RNG = np.random.default_rng(7)


def chunk_sizes(chunks: list[bytes]) -> list[int]:
    return [len(ps_pb2.Chunk.FromString(chunk).data) for chunk in chunks]


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 3000, 4321])
def test_cutting_and_joining_gives_the_message_back_in_chunks_of_the_size_asked(size: int) -> None:
    message = RNG.bytes(size)
    chunks = list(cut(message, size=1000))
    assert gather(chunks, limit=size).joined() == message
    sizes = chunk_sizes(chunks)
    assert sizes == ([1000] * (size // 1000) + ([size % 1000] if size % 1000 else [])) or (
        size == 0 and sizes == [0]
    )


def test_an_encoding_is_cut_from_its_pieces_as_protobuf_would_read_it() -> None:
    encoding = Encoding(ps_pb2.PushGradientsRequest(version=3, pusher_id="w"))
    model_encoding = Encoding()
    arrays = [RNG.normal(size=shape).astype(np.float32) for shape in [(30, 20), (7,), (0,), (333,)]]
    for index, array in enumerate(arrays):
        model_encoding.tensor(ps_layout.MODEL_FIELDS["dense_parameters"], array, f"v{index}")
    encoding.message(ps_layout.PUSH_GRADIENTS, model_encoding)
    chunks = list(cut(encoding, size=512))
    assert max(chunk_sizes(chunks)) == 512 and len(chunks) == -(-encoding.size // 512)
    parsed = ps_pb2.PushGradientsRequest.FromString(gather(chunks, limit=encoding.size).joined())
    assert parsed.version == 3 and parsed.pusher_id == "w"
    for tensor, array in zip(parsed.gradients.dense_parameters, arrays, strict=True):
        assert np.frombuffer(tensor.content, np.float32).tobytes() == array.tobytes()


def test_only_a_messages_final_chunk_is_marked_last_and_a_join_needs_it_at_the_end() -> None:
    chunks = list(cut(b"x" * 2500, size=1000))
    assert [ps_pb2.Chunk.FromString(chunk).last for chunk in chunks] == [False, False, True]
    assert not any(ps_pb2.Chunk.FromString(chunk).last for chunk in cut(b"x" * 2500, size=1000, last=False))
    with pytest.raises(IncompleteMessageError, match="ended before"):
        gather(chunks[:2], limit=2500)  # a stream cut short
    with pytest.raises(IncompleteMessageError, match="after"):
        gather([*chunks, *cut(b"y")], limit=5000)
    body, tail = cut(b"x" * 1500, size=1000, last=False), cut(b"y" * 10)
    assert gather([*body, *tail], limit=5000).joined() == b"x" * 1500 + b"y" * 10


def test_a_join_stops_at_the_limit_and_refuses_what_is_no_chunk() -> None:
    chunks = list(cut(b"x" * 2500, size=1000))
    with pytest.raises(MessageTooLargeError):
        gather(iter(chunks), limit=2499).joined()
    with pytest.raises(WireError):
        gather([b"\x0a\xff\xff"], limit=100).joined()  # a length running past the end


# ---------------------------------------------------------------------------------------- a toy service


SERVICE = "test.Chunks"


#: The requests the toy service's handler read.
ECHOED: list[bytes] = []


def echo(request: ps_pb2.Chunk, _context: grpc.ServicerContext) -> ps_pb2.Chunk:
    ECHOED.append(request.data)
    return ps_pb2.Chunk(data=request.data[::-1])


@pytest.fixture
def toy() -> Iterator[Any]:
    server = make_server()
    method = ChunkedMethod(message_of(ps_pb2.Chunk), echo)
    server.add_generic_rpc_handlers(
        [chunked_service(SERVICE, {"Echo": method}, limit=10_000, arrival_seconds=1.0)]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel
    channel.close()
    server.stop(None)


def test_a_streaming_twin_answers_as_its_method_and_refuses_oversized_and_malformed_requests(
    toy: Any,
) -> None:
    call = ChunkedCall(toy, f"/{SERVICE}/Echo", message_of(ps_pb2.Chunk), limit=MAX_MESSAGE_BYTES)
    data = RNG.bytes(5000)
    assert call(ps_pb2.Chunk(data=data), timeout=10).data == data[::-1]
    with pytest.raises(grpc.RpcError) as oversized:
        call(ps_pb2.Chunk(data=b"y" * 10_001), timeout=10)
    assert oversized.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    raw = toy.stream_stream(f"/{SERVICE}/Echo")
    with pytest.raises(grpc.RpcError) as malformed:
        list(raw(iter([b"\x0a\xff\xff"]), timeout=10))
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as not_a_request:
        list(raw(iter(cut(b"\x0a\x05ab")), timeout=10))  # a Chunk whose data runs past its end
    assert not_a_request.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_request_that_ends_before_its_last_chunk_is_never_read(toy: Any) -> None:
    ECHOED.clear()
    raw = toy.stream_stream(f"/{SERVICE}/Echo")
    with pytest.raises(grpc.RpcError) as cut_short:
        list(raw(cut(ps_pb2.Chunk(data=b"abc").SerializeToString(), last=False), timeout=10))
    assert cut_short.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ended before" in cut_short.value.details() and ECHOED == []


def test_a_pending_call_is_read_with_its_tail_and_never_once_cancelled(toy: Any) -> None:
    """A request sent but for its last bytes: :meth:`PendingCall.finish` sends them and the server reads the
    whole; :meth:`PendingCall.cancel` ends the call, and the server never reads what it had received."""
    ECHOED.clear()
    call = ChunkedCall(toy, f"/{SERVICE}/Echo", message_of(ps_pb2.Chunk), limit=MAX_MESSAGE_BYTES)
    body = ps_pb2.Chunk(data=b"first").SerializeToString()
    pending = call.start(body, timeout=10)
    time.sleep(0.2)  # the body has arrived; the server waits for the rest
    assert ECHOED == []
    tail = ps_pb2.Chunk(data=b"second").SerializeToString()  # the last occurrence of a field wins
    assert pending.finish(tail).data == b"dnoces" and ECHOED == [b"second"]

    cancelled = call.start(body, timeout=10)
    time.sleep(0.2)
    cancelled.cancel()
    time.sleep(0.5)  # a request that ended would be read by now
    assert ECHOED == [b"second"]
    assert call(ps_pb2.Chunk(data=b"after"), timeout=10).data == b"retfa"  # the channel serves on


def test_a_request_that_stops_arriving_is_cancelled_within_the_arrival_time(toy: Any) -> None:
    release = threading.Event()

    def stalled() -> Iterator[bytes]:
        yield from cut(b"z" * 100)
        release.wait(30)  # a client that never finishes its request

    raw = toy.stream_stream(f"/{SERVICE}/Echo")
    started = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as late:
            list(raw(stalled(), timeout=30))
    finally:
        release.set()
    assert late.value.code() == grpc.StatusCode.CANCELLED
    assert time.monotonic() - started < 10


# --------------------------------------------------------------------------------- the parameter server


def test_pushes_and_pulls_in_chunks_change_and_answer_exactly_what_the_unary_calls_do() -> None:
    unary_server, unary_port = start_server(servicer(), "127.0.0.1", 0)
    chunked_server, chunked_port = start_server(servicer(), "127.0.0.1", 0)
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for port in (unary_port, chunked_port)]
    client = ParameterServerClient([f"127.0.0.1:{chunked_port}"], retry_budget_seconds=10)
    try:
        stubs = [ps_pb2_grpc.ParameterServerStub(channel) for channel in channels]
        for stub in stubs:
            assert stub.PushModel(model()).accepted
        gradients = {"w": RNG.normal(size=W.shape).astype(np.float32), "b": np.ones_like(B)}
        reply = push(stubs[0], 0, gradients, return_parameters=True)
        result = client.push_gradients(gradients, {}, versions=[0], return_parameters=True)
        assert result.accepted and reply.accepted and result.versions == (reply.version,) == (1,)
        expected = pull_dense(stubs[0])
        assert result.parameters is not None
        carried, _ = result.parameters
        pulled, versions, initialized = client.pull_dense([-1])
        assert initialized and versions == [1]
        for name in ("w", "b"):
            assert carried[name].tobytes() == expected[name].tobytes() == pulled[name].tobytes()
            assert not np.array_equal(expected[name], model_values()[name])  # the push changed them
        with pytest.raises(grpc.RpcError) as refused:  # checks of the unary method hold for its twin
            client.push_gradients({"w": np.full_like(W, np.nan)}, {}, versions=[1])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'w'" in refused.value.details()
    finally:
        client.close()
        for channel in channels:
            channel.close()
        for server in (unary_server, chunked_server):
            server.stop(None)


def model_values() -> dict[str, np.ndarray]:
    return {t.name: from_tensor(t) for t in model().dense_parameters}


def test_a_streaming_twin_refuses_callers_without_the_jobs_credential() -> None:
    secret = JobSecret.generate()
    server, port = start_server(servicer(), "127.0.0.1", 0, secret=secret)
    try:
        for credential, code in [
            (None, grpc.StatusCode.UNAUTHENTICATED),
            (secret.credential("worker-0"), None),
        ]:
            channel = make_channel(f"127.0.0.1:{port}", credential)
            call = ChunkedCall(
                channel,
                f"/{CHUNKED_SERVICE}/PullDenseParameters",
                message_of(ps_pb2.PullDenseParametersResponse),
                MAX_MESSAGE_BYTES,
            )
            try:
                answer = call(ps_pb2.PullDenseParametersRequest(version=-1), timeout=10)
                assert code is None and not answer.initialized
            except grpc.RpcError as error:
                assert error.code() == code
            finally:
                channel.close()
    finally:
        server.stop(None)
