"""A parameter server bounds and checks what it accepts (issue 24): each test is a hostile or buggy client
against a real PS server, and the PS refuses cleanly (INVALID_ARGUMENT, FAILED_PRECONDITION or
RESOURCE_EXHAUSTED naming the field) while its state and its later answers stay right."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import keras
import numpy as np
import pytest

from edl_argo.proto import ps_pb2, ps_pb2_grpc, tensor_pb2
from edl_argo.ps.server import start_server
from edl_argo.ps.servicer import ParameterServerServicer
from edl_argo.rpc.tensors import from_tensor, to_indexed_slices, to_tensor
from tests.test_ps_service import answer_values

pytestmark = pytest.mark.timeout(120)

W = np.ones((2, 3), np.float32)


Served = tuple[ParameterServerServicer, ps_pb2_grpc.ParameterServerStub, grpc.Channel]


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    """Start a PS (SGD 0.1) with ``settings`` on 127.0.0.1: its servicer, a stub and the stub's channel."""
    opened: list[tuple[grpc.Server, grpc.Channel]] = []

    def start(**settings: Any) -> Served:
        servicer = ParameterServerServicer(lambda: keras.optimizers.SGD(0.1), jit_compile=False, **settings)
        server, port = start_server(servicer, "127.0.0.1", 0)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        opened.append((server, channel))
        return servicer, ps_pb2_grpc.ParameterServerStub(channel), channel

    yield start
    for server, channel in opened:
        channel.close()
        server.stop(None)


@pytest.fixture
def ps(serve: Callable[..., Served]) -> Served:
    """A lone synchronous PS with dense ``w`` (2x3) and table ``emb`` (dim 2), initialised at version 0."""
    servicer, stub, channel = serve()
    table = ps_pb2.EmbeddingTableInfo(name="emb", dim=2, initializer="zeros", dtype="float32")
    assert stub.PushModel(
        ps_pb2.Model(dense_parameters=[to_tensor(W, "w")], embedding_table_infos=[table]), timeout=30
    ).accepted
    return servicer, stub, channel


def refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def dense_push(value: np.ndarray, version: int = 0, **fields: Any) -> ps_pb2.PushGradientsRequest:
    return ps_pb2.PushGradientsRequest(
        gradients=ps_pb2.Model(dense_parameters=[to_tensor(value, "w")]), version=version, **fields
    )


def row_push(
    ids: np.ndarray, values: np.ndarray | None = None, version: int = 0
) -> ps_pb2.PushGradientsRequest:
    values = np.ones((len(ids), 2), np.float32) if values is None else values
    return ps_pb2.PushGradientsRequest(
        gradients=ps_pb2.Model(embedding_tables={"emb": to_indexed_slices(values, ids)}), version=version
    )


def lookup(ids: np.ndarray | tensor_pb2.Tensor) -> ps_pb2.PullEmbeddingVectorsRequest:
    tensor = ids if isinstance(ids, tensor_pb2.Tensor) else to_tensor(ids)
    return ps_pb2.PullEmbeddingVectorsRequest(name="emb", ids=tensor)


def pulled_w(stub: ps_pb2_grpc.ParameterServerStub) -> np.ndarray:
    reply = stub.PullDenseParameters(ps_pb2.PullDenseParametersRequest(version=-1), timeout=30)
    return answer_values(reply)["w"]


# -- item 7: versions ------------------------------------------------------------------------------------


def test_a_model_version_near_int64_max_is_refused_and_the_server_keeps_answering(serve: Any) -> None:
    servicer, stub, _ = serve()
    model = ps_pb2.Model(version=2**63 - 1, dense_parameters=[to_tensor(W, "w")])
    error = refused(lambda: stub.PushModel(model, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "version" in error.details()
    assert not servicer.parameters.initialized
    assert stub.PushModel(ps_pb2.Model(version=3, dense_parameters=[to_tensor(W, "w")]), timeout=30).accepted
    reply = stub.PushGradients(dense_push(np.zeros_like(W), version=3), timeout=30)
    assert reply.accepted and reply.version == 4
    assert stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=30).version == 4


def test_sync_pushes_from_beyond_the_current_version_are_refused(ps: Any) -> None:
    servicer, stub, _ = ps
    reply = stub.PushGradients(dense_push(np.ones_like(W), version=1), timeout=30)  # current 0, tolerance 0
    assert not reply.accepted and reply.version == 0
    for field in ("version", "authority_step"):
        request = dense_push(W, **{field: 2**63 - 1})
        error = refused(lambda r=request: stub.PushGradients(r, timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.details()
    # PS 0 decides the steps: an authority_step sent to it would skip its staleness check.
    error = refused(lambda: stub.PushGradients(dense_push(W, authority_step=5), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "authority_step" in error.details()
    error = refused(lambda: stub.PushGradients(dense_push(W, examples=2**62), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "examples" in error.details()
    assert servicer.version == 0
    np.testing.assert_array_equal(pulled_w(stub), W)
    assert stub.PushGradients(dense_push(np.ones_like(W)), timeout=30).accepted
    np.testing.assert_allclose(pulled_w(stub), W - 0.1)


# -- item 5: non-finite gradients --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradients_are_refused_naming_the_variable_and_counted(ps: Any, bad: float) -> None:
    servicer, stub, _ = ps
    poisoned = np.ones_like(W)
    poisoned[1, 2] = bad
    error = refused(lambda: stub.PushGradients(dense_push(poisoned), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "'w'" in error.details() and "finite" in error.details()
    rows = np.ones((2, 2), np.float32)
    rows[0, 0] = bad
    error = refused(lambda: stub.PushGradients(row_push(np.array([3, 5]), rows), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "'emb'" in error.details()
    assert servicer.version == 0 and servicer.pushes_non_finite == 2
    np.testing.assert_array_equal(pulled_w(stub), W)
    assert len(servicer.parameters.tables["emb"]) == 0  # a refused push creates no rows
    assert stub.PushGradients(dense_push(np.ones_like(W)), timeout=30).accepted
    assert np.isfinite(pulled_w(stub)).all()


# -- item 8 (PS part): shapes and ids ----------------------------------------------------------------------


def test_overflowing_shapes_too_many_dims_and_int32_ids_are_named(ps: Any) -> None:
    servicer, stub, _ = ps
    overflowing = tensor_pb2.Tensor(name="w", dtype="float32", shape=[2**32, 2**32, 2], content=b"")
    many_dims = tensor_pb2.Tensor(name="w", dtype="float32", shape=[1] * 65, content=b"\0" * 4)
    for tensor, words in [(overflowing, "overflow"), (many_dims, "65 dimensions")]:
        request = ps_pb2.PushGradientsRequest(gradients=ps_pb2.Model(dense_parameters=[tensor]))
        error = refused(lambda r=request: stub.PushGradients(r, timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert words in error.details() and "'w'" in error.details(), error.details()
    error = refused(lambda: stub.PullEmbeddingVectors(lookup(np.array([1, 2], np.int32)), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "int32" in error.details() and "int64" in error.details() and "'emb'" in error.details()
    assert "1-D" not in error.details()  # the shape was right: the message names only the dtype
    assert servicer.version == 0


# -- item 4: embedding rows and staging capacity -------------------------------------------------------


def test_the_staging_capacity_shrinks_back_after_one_huge_push(ps: Any) -> None:
    servicer, stub, _ = ps
    optimizer = servicer.parameters._table_optimizers["emb"]
    assert stub.PushGradients(row_push(np.arange(20_000, dtype=np.int64)), timeout=60).accepted
    assert optimizer.capacity >= 20_000
    for step in range(40):
        push = row_push(np.array([step, step + 1]), version=servicer.version)
        assert stub.PushGradients(push, timeout=30).accepted
    assert optimizer.capacity <= 256, optimizer.capacity
    rows = from_tensor(stub.PullEmbeddingVectors(lookup(np.array([0, 19_999])), timeout=30))
    np.testing.assert_allclose(rows, [[-0.2, -0.2], [-0.1, -0.1]], rtol=1e-5)


def test_rows_are_bounded_by_max_embedding_rows_and_a_refused_pull_keeps_none(serve: Any) -> None:
    servicer, stub, _ = serve(max_embedding_rows=1000)
    table = ps_pb2.EmbeddingTableInfo(name="emb", dim=2, initializer="zeros", dtype="float32")
    stub.PushModel(ps_pb2.Model(embedding_table_infos=[table]), timeout=30)
    assert len(from_tensor(stub.PullEmbeddingVectors(lookup(np.arange(600)), timeout=30))) == 600
    error = refused(lambda: stub.PullEmbeddingVectors(lookup(np.arange(600, 1200)), timeout=30))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "'emb'" in error.details() and "--max-embedding-rows" in error.details()
    error = refused(lambda: stub.PushGradients(row_push(np.arange(5000, 5500)), timeout=30))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(servicer.parameters.tables["emb"]) == 600 and servicer.version == 0
    # Known ids stay servable, and new ones up to the bound.
    assert len(from_tensor(stub.PullEmbeddingVectors(lookup(np.arange(400, 1000)), timeout=30))) == 600
    assert len(servicer.parameters.tables["emb"]) == 1000


def test_a_pull_whose_reply_would_be_too_large_is_refused_before_creating_rows(
    ps: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    servicer, stub, _ = ps
    monkeypatch.setattr("edl_argo.ps.bounds.MAX_REPLY_BYTES", 8 * 1000)  # 1000 rows of 2 float32
    error = refused(lambda: stub.PullEmbeddingVectors(lookup(np.arange(1001)), timeout=30))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "'emb'" in error.details()
    assert len(servicer.parameters.tables["emb"]) == 0
    assert len(from_tensor(stub.PullEmbeddingVectors(lookup(np.arange(1000)), timeout=30))) == 1000


# -- item 3: calls that never send their request ---------------------------------------------------------


def test_calls_that_send_headers_but_no_request_do_not_freeze_the_ps(ps: Any) -> None:
    """Each hostile call opens a stream and never sends its request message (nor half-closes). Calls of the
    other methods hold only the other pool: the training step's calls and the master's ping are answered at
    once meanwhile. Calls of the training step's methods hold the priority pool until the PS cancels them
    (its request deadline), and real calls are answered soon after."""
    from edl_argo.ps import serving
    from edl_argo.rpc.health import ping
    from edl_argo.rpc.request_deadline import REQUEST_ARRIVAL_SECONDS

    _, stub, channel = ps
    hold = threading.Event()

    def never() -> Iterator[bytes]:
        hold.wait(60)
        yield b""

    def hostile(method: str, count: int) -> list[grpc.Future]:
        call = channel.stream_unary(f"/edl_argo.ParameterServer/{method}")
        return [call.future(never()) for _ in range(count)]

    def ended(holds: list[grpc.Future]) -> None:
        for future in holds:
            error = future.exception(timeout=REQUEST_ARRIVAL_SECONDS + 20)
            assert error is not None and error.code() in (
                grpc.StatusCode.CANCELLED,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            ), error

    try:
        holds = hostile("PullEmbeddingTable", serving.OTHER_THREADS)
        time.sleep(1.0)
        started = time.monotonic()
        assert stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=40).initialized
        assert stub.PushGradients(dense_push(np.ones_like(W)), timeout=40).accepted
        ping(channel, timeout=40)
        waited = time.monotonic() - started
        assert waited < REQUEST_ARRIVAL_SECONDS / 2, f"the step waited {waited:.1f} s"

        holds += hostile("PushGradients", serving.PROGRESS_THREADS)
        time.sleep(1.0)
        started = time.monotonic()
        assert stub.GetStatus(ps_pb2.GetStatusRequest(), timeout=40).initialized
        assert time.monotonic() - started < REQUEST_ARRIVAL_SECONDS + 10
        ended(holds)
    finally:
        hold.set()
    assert stub.PushGradients(dense_push(np.ones_like(W), version=1), timeout=30).accepted
