"""The parameter server through a real in-process gRPC server, channel and stub on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import keras
import numpy as np
import pytest

from edl_argo.cli import build_parser
from edl_argo.errors import ConfigError
from edl_argo.pods import find_free_port
from edl_argo.proto import ps_pb2, ps_pb2_grpc, tensor_pb2
from edl_argo.ps.checkpoint import decode_state, encode_state, ps_checkpointer, ps_checkpoints, restore_latest
from edl_argo.ps.errors import InvalidRequestError
from edl_argo.ps.parameters import Parameters, ParametersState
from edl_argo.ps.server import PSConfig, create_servicer, serve, start_server
from edl_argo.ps.servicer import ParameterServerServicer
from edl_argo.rpc.auth import SECRET_ENV, JobSecret
from edl_argo.rpc.channel import make_channel
from edl_argo.rpc.packed import read_all
from edl_argo.rpc.tensors import from_indexed_slices, from_tensor, to_indexed_slices, to_tensor
from edl_argo.storage.base import ObjectInfo, ObjectNotFoundError, Storage

LR = 0.1
RNG = np.random.default_rng(0)
W = RNG.normal(size=(2, 3)).astype(np.float32)
B = RNG.normal(size=(3,)).astype(np.float32)


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(LR)


def adam() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01)


class MemoryStorage(Storage):
    """Objects in a dict: enough of the Storage interface for checkpoints."""

    url = "memory://checkpoints"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return [ObjectInfo(k, len(v)) for k, v in sorted(self.objects.items()) if k.startswith(prefix)]

    def stat(self, key: str) -> ObjectInfo:
        if key not in self.objects:
            raise ObjectNotFoundError(f"no object {key}")
        return ObjectInfo(key, len(self.objects[key]))

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.stat(key) and self.objects[key]
        return data[offset : None if length is None else offset + length]

    def write(self, key: str, data: bytes) -> None:
        self.objects[key] = bytes(data)

    def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    def put_tree(self, local_dir: Path, key: str) -> None:
        raise NotImplementedError

    def get_tree(self, key: str, local_dir: Path) -> None:
        raise NotImplementedError


MODEL_FILE = """
import keras
def custom_model(): return keras.Sequential([keras.layers.Dense(1)])
def feed(dataset, mode, metadata): return dataset
def loss(labels, predictions): return 0.0
def optimizer(): return keras.optimizers.SGD(0.1)
def eval_metrics_fn(): return {}
"""


def model(version: int = 0, w: np.ndarray = W) -> ps_pb2.Model:
    return ps_pb2.Model(
        version=version,
        dense_parameters=[to_tensor(w, "w"), to_tensor(B, "b")],
        embedding_table_infos=[
            ps_pb2.EmbeddingTableInfo(name="emb", dim=4, initializer="uniform", dtype="float32")
        ],
    )


def push(
    stub: ps_pb2_grpc.ParameterServerStub,
    version: int,
    dense: dict[str, np.ndarray] | None = None,
    rows: tuple[list[int], np.ndarray] | None = None,
    scale: float = 0.0,
    return_parameters: bool = False,
) -> ps_pb2.PushGradientsResponse:
    gradients = ps_pb2.Model(dense_parameters=[to_tensor(v, n) for n, v in (dense or {}).items()])
    if rows is not None:
        gradients.embedding_tables["emb"].CopyFrom(to_indexed_slices(rows[1], np.array(rows[0])))
    request = ps_pb2.PushGradientsRequest(
        gradients=gradients,
        version=version,
        learning_rate_scale=scale,
        return_parameters=return_parameters,
    )
    return stub.PushGradients(request)


def pull_dense(stub: ps_pb2_grpc.ParameterServerStub, version: int = -1) -> dict[str, np.ndarray]:
    return answer_values(stub.PullDenseParameters(ps_pb2.PullDenseParametersRequest(version=version)))


def answer_values(response: ps_pb2.PullDenseParametersResponse) -> dict[str, np.ndarray]:
    """The parameters of a pull's answer by name, packed or not (edl_argo.rpc.packed)."""
    return dict(read_all(response.dense_parameters, response.packed_parameters))


def pull_rows(stub: ps_pb2_grpc.ParameterServerStub, ids: list[int], name: str = "emb") -> np.ndarray:
    request = ps_pb2.PullEmbeddingVectorsRequest(name=name, ids=to_tensor(np.array(ids, dtype=np.int64)))
    return from_tensor(stub.PullEmbeddingVectors(request))


@pytest.fixture
def connect() -> Iterator[Callable[[ParameterServerServicer], ps_pb2_grpc.ParameterServerStub]]:
    """Serve a servicer on 127.0.0.1 and return a stub on a real channel to it."""
    opened: list[tuple[grpc.Server, grpc.Channel]] = []

    def start(servicer: ParameterServerServicer) -> ps_pb2_grpc.ParameterServerStub:
        server, port = start_server(servicer, "127.0.0.1", 0)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        opened.append((server, channel))
        return ps_pb2_grpc.ParameterServerStub(channel)

    yield start
    for server, channel in opened:
        channel.close()
        server.stop(None)


def servicer(**settings: Any) -> ParameterServerServicer:
    return ParameterServerServicer(settings.pop("factory", sgd), jit_compile=False, **settings)


def test_the_first_push_model_initialises_and_later_ones_are_ignored(connect: Any) -> None:
    stub = connect(servicer())
    response = stub.PullDenseParameters(ps_pb2.PullDenseParametersRequest(version=-1))
    assert not response.initialized and not answer_values(response)
    with pytest.raises(grpc.RpcError) as error:
        push(stub, 0, {"w": W})
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.PushModel(model(version=5)) == ps_pb2.PushModelResponse(accepted=True, version=5)
    assert stub.PushModel(model(w=W + 1)) == ps_pb2.PushModelResponse(accepted=False, version=5)
    values = pull_dense(stub)
    assert np.array_equal(values["w"], W) and np.array_equal(values["b"], B)


def test_pull_dense_returns_nothing_when_the_caller_is_current(connect: Any) -> None:
    stub = connect(servicer(use_async=True))
    stub.PushModel(model())
    current = stub.PullDenseParameters(ps_pb2.PullDenseParametersRequest(version=0))
    assert current.initialized and current.version == 0 and not answer_values(current)
    assert push(stub, 0, {"b": np.ones(3, np.float32)}).version == 1
    assert sorted(pull_dense(stub, version=0)) == ["b", "w"]
    assert sorted(pull_dense(stub, version=7)) == ["b", "w"]  # a caller ahead of a restarted server
    assert pull_dense(stub, version=1) == {}


def test_embedding_rows_are_created_lazily_and_stay_consistent(connect: Any) -> None:
    stub = connect(servicer())
    stub.PushModel(model())
    first = pull_rows(stub, [1, 5, 9])
    again = pull_rows(stub, [9, 1, 13])
    assert first.shape == (3, 4) and first.dtype == np.float32
    assert np.array_equal(again[0], first[2]) and np.array_equal(again[1], first[0])
    values, ids = from_indexed_slices(stub.PullEmbeddingTable(ps_pb2.PullEmbeddingTableRequest(name="emb")))
    assert sorted(ids.tolist()) == [1, 5, 9, 13]
    assert np.array_equal(values[ids.tolist().index(13)], again[2])
    assert pull_rows(stub, []).shape == (0, 4)


def test_async_applies_each_push_and_modulates_stale_learning_rates(connect: Any) -> None:
    stub = connect(servicer(use_async=True, lr_staleness_modulation=True))
    stub.PushModel(model())
    rows = pull_rows(stub, [2, 4])
    g_w, g_rows = np.ones_like(W), np.full((3, 4), 0.5, np.float32)
    response = push(stub, 0, {"w": g_w}, ([4, 2, 4], g_rows))
    assert response.accepted and response.version == 1
    np.testing.assert_allclose(pull_dense(stub)["w"], W - LR * g_w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        pull_rows(stub, [2, 4]), rows - LR * np.array([[0.5], [1.0]]), rtol=1e-6, atol=1e-6
    )
    push(stub, 1, {"w": g_w})  # version 2
    # Computed against version 0 while the server is at 2: staleness 2 halves the learning rate.
    assert push(stub, 0, {"w": g_w}, scale=3.0).version == 3
    np.testing.assert_allclose(pull_dense(stub)["w"], W - LR * g_w * (2 + 3.0 / 2), rtol=1e-6, atol=1e-6)


def test_sync_averages_grads_to_wait_pushes_and_bumps_the_version_once(connect: Any) -> None:
    stub = connect(servicer(grads_to_wait=2))
    stub.PushModel(model())
    rows = pull_rows(stub, [3, 7])
    g1, g2 = np.full_like(W, 1.0), np.full_like(W, 3.0)
    first = push(stub, 0, {"w": g1}, ([3], np.ones((1, 4), np.float32)))
    assert first.accepted and first.version == 0
    assert np.array_equal(pull_dense(stub)["w"], W)
    second = push(stub, 0, {"w": g2, "b": np.ones(3, np.float32)}, ([3, 7], np.ones((2, 4), np.float32)))
    assert second.accepted and second.version == 1
    values = pull_dense(stub)
    np.testing.assert_allclose(values["w"], W - LR * (g1 + g2) / 2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(values["b"], B - LR * 0.5, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        pull_rows(stub, [3, 7]), rows - LR * np.array([[1.0], [0.5]]), rtol=1e-6, atol=1e-6
    )


def test_stale_sync_pushes_are_refused_beyond_the_tolerance(connect: Any) -> None:
    strict = connect(servicer())
    strict.PushModel(model())
    assert push(strict, 0, {"w": np.ones_like(W)}).version == 1
    refused = push(strict, 0, {"w": np.ones_like(W)})
    assert not refused.accepted and refused.version == 1
    np.testing.assert_allclose(pull_dense(strict)["w"], W - LR, rtol=1e-6, atol=1e-6)

    tolerant = connect(servicer(sync_version_tolerance=1))
    tolerant.PushModel(model())
    assert push(tolerant, 0, {"w": np.ones_like(W)}).accepted
    assert push(tolerant, 0, {"w": np.ones_like(W)}).accepted
    assert not push(tolerant, 0, {"w": np.ones_like(W)}).accepted


def test_a_push_reply_carries_what_a_pull_right_after_it_gets(connect: Any) -> None:
    stub = connect(servicer(grads_to_wait=2))
    stub.PushModel(model())
    g1, g2 = np.full_like(W, 1.0), np.full_like(W, 3.0)
    assert not push(stub, 0, {"w": g1}).HasField("parameters")  # not asked
    waiting = push(stub, 0, {"w": g2}, return_parameters=True)  # completes step 1
    assert waiting.accepted and waiting.parameters.version == 1 and waiting.parameters.initialized
    carried = answer_values(waiting.parameters)
    np.testing.assert_allclose(carried["w"], W - LR * (g1 + g2) / 2, rtol=1e-6, atol=1e-6)
    assert {n: v.tolist() for n, v in carried.items()} == {n: v.tolist() for n, v in pull_dense(stub).items()}
    # The step is not complete: nothing changed since the push's version.
    half = push(stub, 1, {"w": g1}, return_parameters=True)
    assert half.accepted and half.parameters.version == 1 and not answer_values(half.parameters)
    # Refused as stale: the reply carries the current parameters to recompute from.
    stale = push(stub, 0, {"w": g1}, return_parameters=True)
    assert not stale.accepted and stale.parameters.version == 1
    assert sorted(answer_values(stale.parameters)) == ["b", "w"]


def test_invalid_requests_are_rejected_with_a_reason_and_the_server_keeps_serving(connect: Any) -> None:
    layout = {"w": W.nbytes, "b": B.nbytes}  # on 2 PS, "w" (the larger) is PS 0's, "b" PS 1's
    stub = connect(servicer(ps_id=0, num_ps=2, use_async=True))
    assert stub.PushModel(ps_pb2.Model(dense_parameters=[to_tensor(W, "w")], dense_layout=layout)).accepted
    other = connect(servicer(ps_id=0, num_ps=2))
    bad_bytes = tensor_pb2.Tensor(name="w", dtype="float32", shape=[2, 3], content=b"\0" * 5)
    float_ids = tensor_pb2.Tensor(name="ids", dtype="float32", shape=[1], content=b"\0" * 4)
    calls: list[tuple[Callable[[], Any], str]] = [
        (lambda: push(stub, 0, {"nope": W}), "'nope'"),
        (lambda: push(stub, 0, {"w": np.ones((3, 2), np.float32)}), "'w'"),
        (lambda: push(stub, 0, {"w": W.astype(np.float64)}), "float64"),
        (lambda: push(stub, 0, {"w": W}, ([1], np.ones((1, 4), np.float32))), "'emb'"),
        (lambda: push(stub, 0, {"w": W}, scale=-1.0), "learning_rate_scale"),
        (
            lambda: stub.PushGradients(
                ps_pb2.PushGradientsRequest(gradients={"dense_parameters": [bad_bytes]})
            ),
            "'w'",
        ),
        (lambda: pull_rows(stub, [1]), "'emb'"),
        (
            lambda: other.PushModel(ps_pb2.Model(dense_parameters=[to_tensor(B, "b")], dense_layout=layout)),
            "'b' belongs to PS 1",
        ),
        (lambda: other.PushModel(ps_pb2.Model(dense_layout=layout)), "'w' of PS 0 is missing"),
        (
            lambda: other.PushModel(
                ps_pb2.Model(dense_parameters=[to_tensor(W, "w")], dense_layout={**layout, "w": 4})
            ),
            "'w' has 24 bytes, its dense_layout 4",
        ),
        (lambda: other.PushModel(ps_pb2.Model(dense_layout={"w": -1})), "'w' has a negative size"),
        (lambda: other.PushModel(model()), "'b' is not in the model's dense_layout"),
    ]
    for call, reason in calls:
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        assert reason in error.value.details()
        assert "\n" not in error.value.details()
    other.PushModel(ps_pb2.Model(embedding_table_infos=[ps_pb2.EmbeddingTableInfo(name="emb", dim=2)]))
    for request in (
        ps_pb2.PullEmbeddingVectorsRequest(name="emb", ids=to_tensor(np.array([3], dtype=np.int64))),
        ps_pb2.PullEmbeddingVectorsRequest(name="emb", ids=float_ids),
    ):
        with pytest.raises(grpc.RpcError) as error:
            other.PullEmbeddingVectors(request)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert pull_rows(other, [2, 4]).shape == (2, 2)
    assert push(stub, 0, {"w": np.ones_like(W)}).version == 1
    np.testing.assert_allclose(pull_dense(stub)["w"], W - LR, rtol=1e-6, atol=1e-6)


def test_settings_are_checked_at_startup() -> None:
    with pytest.raises(ConfigError, match="grads-to-wait"):
        servicer(grads_to_wait=0)
    with pytest.raises(ConfigError, match="use-async"):
        servicer(lr_staleness_modulation=True)
    with pytest.raises(ConfigError, match="grads-to-wait"):
        servicer(use_async=True, grads_to_wait=2)
    with pytest.raises(ConfigError, match="schedule"):
        servicer(
            use_async=True,
            lr_staleness_modulation=True,
            factory=lambda: keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)),
        )
    with pytest.raises(ConfigError, match="checkpoint-dir"):
        create_servicer(PSConfig(checkpoint_steps=5), optimizer_factory=sgd)


def assert_same_state(a: ParametersState, b: ParametersState) -> None:
    assert a.version == b.version
    assert a.dense.keys() == b.dense.keys() and a.tables.keys() == b.tables.keys()
    for name in a.dense:
        assert np.array_equal(a.dense[name], b.dense[name])
    assert len(a.dense_optimizer) == len(b.dense_optimizer) > 2
    for x, y in zip(a.dense_optimizer, b.dense_optimizer, strict=True):
        assert np.array_equal(x, y)
    for name, table in a.tables.items():
        other = b.tables[name]
        order_a, order_b = np.argsort(table.arrays.ids), np.argsort(other.arrays.ids)
        assert np.array_equal(table.arrays.ids[order_a], other.arrays.ids[order_b])
        assert np.array_equal(table.arrays.values[order_a], other.arrays.values[order_b])
        assert table.arrays.slots.keys() == other.arrays.slots.keys() == {"momentum", "velocity"}
        for slot in table.arrays.slots:
            assert np.array_equal(table.arrays.slots[slot][order_a], other.arrays.slots[slot][order_b])
        assert [int(x) for x in table.optimizer if x.shape == ()] == [
            int(y) for y in other.optimizer if y.shape == ()
        ]
        assert np.array_equal(table.seed_state, other.seed_state)


def test_checkpoints_restore_identical_state_that_continues_identically(connect: Any) -> None:
    storage = MemoryStorage()
    config = PSConfig(use_async=True, checkpoint_steps=2)
    original = create_servicer(config, optimizer_factory=adam, storage=storage)
    stub = connect(original)
    stub.PushModel(model())
    rng = np.random.default_rng(3)

    def step(target: ps_pb2_grpc.ParameterServerStub, version: int) -> None:
        pull_rows(target, [1, 2, 3, 10 + version])  # creates one new row per step
        grads = {"w": rng.normal(size=W.shape).astype(np.float32), "b": np.ones(3, np.float32)}
        push(target, version, grads, ([1, 3, 10 + version], rng.normal(size=(3, 4)).astype(np.float32)))

    for version in range(7):
        step(stub, version)
        original._checkpointer.wait()  # type: ignore[union-attr]
    assert [v for v, _ in ps_checkpoints(storage, 0).list()] == [2, 4, 6]
    assert original.save_checkpoint(timeout=30)  # the graceful-stop save: version 7
    assert [v for v, _ in ps_checkpoints(storage, 0).list()] == [4, 6, 7]

    restored = create_servicer(config, optimizer_factory=adam, storage=storage)
    assert restored.version == 7
    assert not connect(restored).PushModel(model(w=W + 1)).accepted
    assert_same_state(original.parameters.snapshot(), restored.parameters.snapshot())

    state = rng.bit_generator.state
    for version in range(7, 9):
        step(stub, version)
    rng.bit_generator.state = state
    restored_stub = connect(restored)
    for version in range(7, 9):
        step(restored_stub, version)
    assert_same_state(original.parameters.snapshot(), restored.parameters.snapshot())
    with pytest.raises(ConfigError, match="does not fit"):
        create_servicer(
            config, optimizer_factory=lambda: keras.optimizers.SGD(0.1, momentum=0.9), storage=storage
        )


def test_a_checkpoint_keeps_the_model_layout_and_restores_only_where_it_places_the_same_variables() -> None:
    layout = {"w": W.nbytes, "b": B.nbytes}  # on 2 PS, "w" is PS 0's and "b" PS 1's
    first = Parameters(sgd, ps_id=1, num_ps=2, jit_compile=False)
    assert first.init_from_model(ps_pb2.Model(dense_parameters=[to_tensor(B, "b")], dense_layout=layout))
    state = decode_state(encode_state(first.snapshot()))
    assert state.layout == layout and list(state.dense) == ["b"]

    relaunched = Parameters(sgd, ps_id=1, num_ps=2, jit_compile=False)
    relaunched.restore(state)
    # A worker of the same model is told the PS has its model; one of another model, that it differs.
    assert not relaunched.init_from_model(ps_pb2.Model(dense_layout=layout))
    with pytest.raises(InvalidRequestError, match=r"dense layout differs .* at dense variable 'b'"):
        relaunched.init_from_model(ps_pb2.Model(dense_layout={**layout, "b": 2 * B.nbytes}))
    with pytest.raises(InvalidRequestError, match="at dense variable 'v'"):
        relaunched.init_from_model(ps_pb2.Model(dense_layout={**layout, "v": 4}))
    with pytest.raises(
        ConfigError, match=r"does not fit --num-ps 3 \(dense variable 'b' belongs to PS 1 of 3, not to PS 2\)"
    ):
        Parameters(sgd, ps_id=2, num_ps=3, jit_compile=False).restore(state)
    with pytest.raises(
        ConfigError, match=r"does not fit --num-ps 2 \(dense variable 'b' belongs to PS 1 of 2, not to PS 0\)"
    ):
        Parameters(sgd, ps_id=0, num_ps=2, jit_compile=False).restore(state)
    # Written before dense variables were placed by size: only a single PS knows it holds them all.
    legacy = decode_state(encode_state(ParametersState(**{**state.__dict__, "layout": {}})))
    assert legacy.layout == {}
    with pytest.raises(ConfigError, match="placed dense variables by name"):
        Parameters(sgd, ps_id=1, num_ps=2, jit_compile=False).restore(legacy)
    alone = Parameters(sgd, jit_compile=False)
    alone.restore(legacy)
    assert alone.layout == {"b": B.nbytes}


def test_a_checkpoint_with_one_slot_per_small_variable_is_refused_naming_what_to_do() -> None:
    """Before 0.2.0 a PS kept Adam's slots per variable; 0.2.0 holds w and b packed, with one slot pair."""
    packed = Parameters(adam, jit_compile=False)
    assert packed.init_from_model(ps_pb2.Model(dense_parameters=[to_tensor(W, "w"), to_tensor(B, "b")]))
    state = packed.snapshot()
    per_variable = adam()
    per_variable.build([keras.Variable(W), keras.Variable(B)])  # as a PS before 0.2.0 held them
    older = ParametersState(
        **{**state.__dict__, "dense_optimizer": [v.numpy() for v in per_variable.variables]}
    )
    with pytest.raises(ConfigError, match=r"by an edl-argo before 0\.2\.0 .* start the job without it"):
        Parameters(adam, jit_compile=False).restore(older)
    restored = Parameters(adam, jit_compile=False)
    restored.restore(state)
    assert {n: v.tolist() for n, v in restored.dense_values().items()} == {"w": W.tolist(), "b": B.tolist()}


def test_unreadable_checkpoints_are_skipped_and_saves_are_spaced() -> None:
    storage = MemoryStorage()
    assert restore_latest(storage, 0) is None
    ps = servicer(use_async=True, factory=adam, checkpointer=ps_checkpointer(storage, 0, every=3))
    ps.parameters.init_from_model(model())
    checkpointer = ps._checkpointer
    assert checkpointer is not None and not checkpointer.due(2) and checkpointer.due(3)
    checkpointer.submit(ps.parameters.snapshot())
    checkpointer.wait()
    storage.write(ps_checkpoints(storage, 0).key(9), b"not a checkpoint")
    restored = restore_latest(storage, 0)
    assert restored is not None and restored.version == 0
    assert restore_latest(storage, 1) is None


def test_cli_flags_and_serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_file = tmp_path / "model.py"
    model_file.write_text(MODEL_FILE)
    parser = build_parser(["ps"])
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    args = parser.parse_args(["ps", "--model-def", str(model_file), "--num-ps", "2", "--ps-id", "1"])
    assert (args.ps_id, args.num_ps, args.port, args.grads_to_wait, args.use_async) == (1, 2, 2222, 1, False)
    assert (args.checkpoint_dir, args.checkpoint_steps, args.sync_version_tolerance) == ("", 0, 0)
    assert PSConfig().host == "10.1.2.3"
    with pytest.raises(SystemExit):
        parser.parse_args(["ps", "--model-def", "m.py", "--grads-to-wait", "0"])
    assert parser.parse_args(["ps", "--model_def", "m.py", "--use_async"]).use_async  # ElasticDL spelling

    port = find_free_port()
    config = PSConfig(model_def=str(model_file), host="127.0.0.1", port=port, checkpoint_dir=str(tmp_path))
    server = serve(config)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            assert stub.PushModel(ps_pb2.Model(dense_parameters=[to_tensor(B, "b")])).accepted
    finally:
        server.stop(None)


def test_concurrent_async_pushes_each_apply_once(connect: Any) -> None:
    stub = connect(servicer(use_async=True))
    stub.PushModel(model())
    ones = np.ones_like(W)

    def worker() -> None:
        for _ in range(5):
            push(stub, 0, {"w": ones})

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    response = stub.PullDenseParameters(ps_pb2.PullDenseParametersRequest(version=-1))
    assert response.version == 20
    np.testing.assert_allclose(answer_values(response)["w"], W - 20 * LR, rtol=1e-5)


def test_ps_command_stops_gracefully_on_sigterm_with_a_last_checkpoint(tmp_path: Path) -> None:
    model_file = tmp_path / "model.py"
    model_file.write_text(MODEL_FILE)
    port = find_free_port()
    flags = ["ps", "--model-def", str(model_file), "--port", str(port), "--use-async"]
    flags += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-steps", "100"]
    secret = JobSecret.generate()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "POD_IP": "127.0.0.1", SECRET_ENV: secret.hex()}
    process = subprocess.Popen(
        [sys.executable, "-m", "edl_argo.cli", *flags], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        with make_channel(f"127.0.0.1:{port}", secret.credential("worker-0")) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            assert stub.PushModel(ps_pb2.Model(dense_parameters=[to_tensor(B, "b")])).accepted
            assert push(stub, 0, {"b": np.ones(3, np.float32)}).version == 1
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert "ps_stopped" in stderr and "checkpoint_saved" in stderr
    assert (tmp_path / "ckpt" / "ps-0" / "version-0000000001.ckpt").is_file()


@pytest.mark.parametrize(
    ("num_ps", "use_async", "slow_ps", "grads_to_wait"),
    [
        (1, True, 0, 1),
        (1, False, 0, 1),
        (2, False, 0, 1),
        (2, False, 1, 1),
        (1, False, 0, 2),
        (2, False, 1, 2),
    ],
    ids=[
        "async",
        "sync",
        "sync-2ps-authority-slow",
        "sync-2ps-follower-slow",
        "sync-grads-to-wait-2",
        "sync-2ps-follower-slow-grads-to-wait-2",
    ],
)
def test_a_push_retried_after_its_deadline_is_applied_once(
    num_ps: int, use_async: bool, slow_ps: int, grads_to_wait: int
) -> None:
    """The PS takes a push but answers after the caller's deadline (it compiled its first update, say):
    the client retries it, and the PS answers the retry from the push it already took instead of taking the
    minibatch a second time. With ``grads_to_wait`` 2 the retry would complete the step on its own; the
    step must be the mean of the first push and the next one (gradients 1 and 3: a step of 2)."""
    from edl_argo.worker.ps_client import ParameterServerClient

    servicers = [
        servicer(ps_id=i, num_ps=num_ps, use_async=use_async, factory=sgd, grads_to_wait=grads_to_wait)
        for i in range(num_ps)
    ]
    slowed = servicers[slow_ps]
    decide = slowed._decide_push
    delays = [1.5]

    def late_decision(*args: Any, **kwargs: Any) -> Any:
        outcome = decide(*args, **kwargs)
        if delays:
            time.sleep(delays.pop())  # taken, but the caller's deadline runs out before the answer
        return outcome

    slowed._decide_push = late_decision  # type: ignore[method-assign]
    servers = [start_server(s, "127.0.0.1", 0) for s in servicers]
    client = ParameterServerClient([f"127.0.0.1:{port}" for _, port in servers], rpc_timeout_seconds=0.5)
    try:
        dense = {"w": W, "b": B}
        client.push_model(dense, [])
        client.synchronous = not use_async
        result = client.push_gradients({n: np.ones_like(v) for n, v in dense.items()}, {}, [0] * num_ps)
        assert result.accepted and not delays  # the slow answer happened, and was retried
        if grads_to_wait == 2:
            assert [s.version for s in servicers] == [0] * num_ps  # one push taken: no step yet
            result = client.push_gradients(
                {n: 3 * np.ones_like(v) for n, v in dense.items()}, {}, [0] * num_ps
            )
            assert result.accepted
        time.sleep(1.5)  # the first attempt's answer has been sent by now
        assert [s.version for s in servicers] == [1] * num_ps
        statuses = client.status()
        assert [s.pushes_accepted for s in statuses] == [grads_to_wait] * num_ps
        pulled = {n: v for s in servicers for n, v in s.parameters.pull_dense(since_version=-1) or []}
        np.testing.assert_allclose(pulled["w"], W - LR * grads_to_wait, rtol=1e-6)
    finally:
        client.close()
        for server, _ in servers:
            server.stop(None)


def test_a_restored_ps_refuses_a_push_its_checkpoint_already_holds(connect: Any) -> None:
    """A PS restarted from its checkpoint has forgotten which pushes it answered; a push from before the
    restart that its checkpoint holds (the retry of one whose answer was lost with the PS) is refused as
    stale, not taken again, and one its checkpoint lost (taken, its step not yet applied) is taken again."""
    storage = MemoryStorage()
    first = servicer(grads_to_wait=2, checkpointer=ps_checkpointer(storage, 0, every=1))
    stub = connect(first)
    stub.PushModel(model())

    def push_as(target: Any, sequence: int, version: int, gradient: float) -> ps_pb2.PushGradientsResponse:
        gradients = ps_pb2.Model(dense_parameters=[to_tensor(np.full_like(W, gradient), "w")])
        request = ps_pb2.PushGradientsRequest(
            gradients=gradients, version=version, pusher_id="worker-0", sequence=sequence
        )
        return target.PushGradients(request)

    assert push_as(stub, 1, 0, 1.0).accepted and push_as(stub, 2, 0, 3.0).accepted  # one step: mean 2
    assert push_as(stub, 3, 1, 5.0).accepted  # taken, its step waits for a second push
    assert first._checkpointer is not None and first._checkpointer.wait(10)
    restored_state = restore_latest(storage, 0)
    assert restored_state is not None and restored_state.version == 1
    restored = connect(servicer(grads_to_wait=2, initial_state=restored_state))
    late = push_as(restored, 2, 0, 3.0)  # held by the checkpoint: refused
    assert (late.accepted, late.version) == (False, 1)
    assert push_as(restored, 3, 1, 5.0).accepted and push_as(restored, 4, 1, 7.0).accepted
    status = restored.GetStatus(ps_pb2.GetStatusRequest())
    assert (status.version, status.pushes_accepted, status.pushes_refused) == (2, 2, 1)
    np.testing.assert_allclose(pull_dense(restored)["w"], W - LR * 2.0 - LR * 6.0, rtol=1e-6)


def test_a_late_attempt_is_neither_applied_nor_accepted_and_push_ids_are_bounded(connect: Any) -> None:
    from edl_argo.ps.bounds import MAX_PUSHER_ID_CHARS
    from edl_argo.ps.push_memory import PushMemory, PushOutcome

    stub = connect(servicer(use_async=True))
    stub.PushModel(model())

    def push_as(pusher: str, sequence: int) -> ps_pb2.PushGradientsResponse:
        gradients = ps_pb2.Model(dense_parameters=[to_tensor(np.ones_like(W), "w")])
        request = ps_pb2.PushGradientsRequest(gradients=gradients, pusher_id=pusher, sequence=sequence)
        return stub.PushGradients(request)

    assert push_as("a", 2).version == 1
    assert push_as("b", 1).version == 2  # another pusher's numbers are its own
    late = push_as("a", 1)  # an attempt "a" gave up on, delivered after its next push
    repeat = push_as("a", 2)
    assert (late.accepted, late.version, repeat.accepted, repeat.version) == (False, 2, True, 2)
    status = stub.GetStatus(ps_pb2.GetStatusRequest())
    assert (status.pushes_accepted, status.pushes_repeated) == (2, 2)
    for pusher, sequence in (("x" * (MAX_PUSHER_ID_CHARS + 1), 1), ("a", 0)):
        with pytest.raises(grpc.RpcError) as refused:
            push_as(pusher, sequence)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.GetStatus(ps_pb2.GetStatusRequest()).version == 2

    memory = PushMemory(max_pushers=2)
    for pusher in ("a", "b", "c"):  # "a" is forgotten: the least recently seen
        memory.remember(pusher, PushOutcome(5, accepted=True))
    assert memory.recall("a", 5) is None and memory.recall("c", 5) == PushOutcome(5, accepted=True)
