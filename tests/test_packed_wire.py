"""Small tensors packed by dtype on the wire (edl_argo.rpc.packed): what is packed, that every array comes
back exactly from any cut of the bytes, and that a packed message whose members and data disagree fails
with an error naming the member, at the reader and at the PS."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from edl_argo.proto import ps_pb2, ps_pb2_grpc, tensor_pb2
from edl_argo.ps.pushed import PushedGradients
from edl_argo.ps.server import start_server
from edl_argo.rpc import packed, ps_layout
from edl_argo.rpc.packed import (
    SMALL_ARRAY_BYTES,
    encode_named,
    group_small,
    read_packed,
    read_packed_rope,
)
from edl_argo.rpc.rope import ALIGNMENT, Rope
from edl_argo.rpc.tensors import TensorDecodeError, to_tensor
from edl_argo.rpc.wire import Encoding
from edl_argo.worker.ps_client import DenseAnswer, push_request
from tests.test_ps_service import B, W, model, servicer
from tests.test_wire import decoding_errors

RNG = np.random.default_rng(11)
#: Just below the bound, packed; at the bound, alone.
BELOW, AT = SMALL_ARRAY_BYTES // 4 - 1, SMALL_ARRAY_BYTES // 4

VALUES = {
    "conv/kernel": RNG.normal(size=(3, 3, 4, 8)).astype(np.float32),
    "conv/bias": RNG.normal(size=(8,)).astype(np.float32),
    "norm/gamma": RNG.normal(size=(8,)).astype(np.float32),
    "norm/empty": np.zeros((0, 5), np.float32),
    "scale": np.asarray(RNG.normal(), np.float32),  # 0 dimensions
    "below": RNG.normal(size=(BELOW,)).astype(np.float32),
    "at": RNG.normal(size=(AT,)).astype(np.float32),
    "steps": np.arange(6, dtype=np.int64).reshape(2, 3),
    "count": np.array([7], np.int64),
    "half": RNG.normal(size=(4,)).astype(np.float16),  # the only float16: alone
}


def test_small_arrays_group_by_dtype_in_order_and_large_ones_stay_alone() -> None:
    specs = [(value.nbytes, value.dtype) for value in VALUES.values()]
    groups, alone = group_small(specs)
    names = list(VALUES)
    assert {dtype.name: [names[i] for i in members] for dtype, members in groups.items()} == {
        "float32": ["conv/kernel", "conv/bias", "norm/gamma", "norm/empty", "scale", "below"],
        "int64": ["steps", "count"],
        "float16": ["half"],
    }
    assert [names[i] for i in alone] == ["at"]


def encoded_answer(values: dict[str, np.ndarray]) -> bytes:
    fields = ps_pb2.PullDenseParametersResponse(initialized=True, version=5, synchronous=True)
    encoding = encode_named(Encoding(fields), ps_layout.ANSWER_PARAMETERS, ps_layout.ANSWER_PACKED, values)
    return encoding.tobytes()


@pytest.mark.parametrize("chunk_bytes", [7, 1000, 10**9])
def test_every_array_comes_back_exactly_from_any_cut_of_a_packed_answer_and_push(chunk_bytes: int) -> None:
    data = encoded_answer(VALUES)
    message = ps_pb2.PullDenseParametersResponse.FromString(data)
    assert len(data) == message.ByteSize()  # a message protobuf reads whole, nothing more
    assert [[m.name for m in group.members] for group in message.packed_parameters] == [
        ["conv/kernel", "conv/bias", "norm/gamma", "norm/empty", "scale", "below"],
        ["steps", "count"],
    ]
    assert sorted(t.name for t in message.dense_parameters) == ["at", "half"]
    parts = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)]
    answer = DenseAnswer.parse(Rope(parts))
    assert (answer.initialized, answer.version, answer.synchronous) == (True, 5, True)
    assert sorted(answer.values) == sorted(VALUES)
    for name, value in VALUES.items():
        got = answer.values[name]
        assert got.dtype == value.dtype and got.shape == value.shape and got.tobytes() == value.tobytes()
        assert not got.flags.writeable
        assert not any(np.shares_memory(got, np.frombuffer(part, np.uint8)) for part in parts)
    # Each packed group is one buffer of its own, aligned: its first member starts it.
    assert answer.values["conv/kernel"].ctypes.data % ALIGNMENT == 0
    assert np.shares_memory(answer.values["conv/kernel"].base, answer.values["below"])

    fields = ps_pb2.PushGradientsRequest(version=3, pusher_id="w", sequence=1)
    state = {"norm/mean": VALUES["norm/gamma"], "norm/var": VALUES["conv/bias"]}
    pushed_bytes = push_request(fields, VALUES, state, {}).tobytes()
    pieces = [pushed_bytes[i : i + chunk_bytes] for i in range(0, len(pushed_bytes), chunk_bytes)]
    pushed = PushedGradients.parse(Rope(pieces))
    assert pushed.fields.version == 3 and pushed.fields.pusher_id == "w"
    for got_named, want in ((pushed.gradients.dense, VALUES), (pushed.gradients.non_trainable, state)):
        got = dict(got_named)
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            assert got[name].dtype == value.dtype and got[name].tobytes() == value.tobytes()
    parsed = ps_pb2.PushGradientsRequest.FromString(pushed_bytes)
    assert len(parsed.gradients.packed_non_trainable_parameters) == 1


def packed_message(members: list[tuple[str, tuple[int, ...]]], data: np.ndarray | None) -> bytes:
    message = tensor_pb2.PackedTensors(
        members=[tensor_pb2.PackedMember(name=name, shape=shape) for name, shape in members]
    )
    if data is not None:
        message.data.CopyFrom(to_tensor(data))
    return message.SerializeToString()


FLOATS = np.arange(10, dtype=np.float32)


@pytest.mark.parametrize(
    ("members", "data", "message"),
    [
        ([("a/w", (2, 3)), ("a/b", (5,))], FLOATS, "'a/b': shape \\(5,\\) runs past the 10 elements"),
        ([("a/w", (2, 3)), ("a/b", (3,))], FLOATS, "'a/w': the members hold 9 elements, the data 10"),
        ([("a/w", (2, -5))], FLOATS, "'a/w': negative dimension"),
        ([("a/w", (1,) * 65)], FLOATS, "'a/w': 65 dimensions"),
        ([("a/w", (2**40, 2**40))], FLOATS, "'a/w': the size of shape .* overflows int64"),
        ([("a/w", (10,))], FLOATS.reshape(2, 5), "'a/w': the data has shape \\(2, 5\\), not one dimension"),
        ([("a/w", (10,))], None, "'a/w': no data"),
    ],
)
def test_members_and_data_that_disagree_fail_naming_the_member(
    members: list[tuple[str, tuple[int, ...]]], data: np.ndarray | None, message: str
) -> None:
    serialized = packed_message(members, data)
    for read in (
        lambda: read_packed_rope(Rope([serialized[:3], serialized[3:]])),
        lambda: read_packed(tensor_pb2.PackedTensors.FromString(serialized)),
    ):
        with pytest.raises(TensorDecodeError, match=message):
            read()


def test_damaged_packed_answers_fail_with_a_decoding_error_and_nothing_else() -> None:
    data = encoded_answer({name: VALUES[name] for name in ("conv/bias", "norm/gamma", "steps", "count")})
    assert decoding_errors(data, DenseAnswer.parse, RNG) > len(data) // 2


@pytest.fixture
def stub() -> Iterator[ps_pb2_grpc.ParameterServerStub]:
    """A stub on a real channel to a PS (SGD) served on 127.0.0.1."""
    server, port = start_server(servicer(), "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield ps_pb2_grpc.ParameterServerStub(channel)
    channel.close()
    server.stop(None)


def test_the_ps_refuses_a_packed_push_naming_the_member_at_fault_and_applies_a_good_one(
    stub: ps_pb2_grpc.ParameterServerStub,
) -> None:
    assert stub.PushModel(model()).accepted
    fields = ps_pb2.PushGradientsRequest(version=0, pusher_id="w", sequence=1, return_parameters=True)

    def send(gradients: dict[str, np.ndarray], sequence: int) -> ps_pb2.PushGradientsResponse:
        fields.sequence = sequence
        request = ps_pb2.PushGradientsRequest.FromString(push_request(fields, gradients, {}, {}).tobytes())
        assert len(request.gradients.packed_dense_parameters) == 1  # w and b, packed
        return stub.PushGradients(request)

    for gradients, message in (
        ({"w": np.ones_like(W), "b": np.full_like(B, np.nan)}, "'b'"),
        ({"w": np.ones_like(W), "bias": np.ones_like(B)}, "'bias'"),
        ({"w": np.ones_like(W), "b": np.ones((B.size + 1,), B.dtype)}, "'b'"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            send(gradients, 1)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in refused.value.details()
    reply = send({"w": np.ones_like(W), "b": np.ones_like(B)}, 2)
    assert reply.accepted and reply.version == 1
    carried = dict(DenseAnswer.parse(Rope([reply.parameters.SerializeToString()])).values)
    assert not np.array_equal(carried["w"], W) and not np.array_equal(carried["b"], B)


def members_first(members: list[tuple[str, tuple[int, ...]]], data: np.ndarray) -> bytes:
    """A ``PackedTensors`` with its members before its data: a valid order protobuf does not write."""
    head = tensor_pb2.PackedTensors(
        members=[tensor_pb2.PackedMember(name=name, shape=shape) for name, shape in members]
    ).SerializeToString()
    return head + tensor_pb2.PackedTensors(data=to_tensor(data)).SerializeToString()


def test_the_encoder_writes_data_first_and_both_orders_read_back_the_same_arrays() -> None:
    members = [("a/w", (2, 3)), ("a/b", (4,))]
    data = np.arange(10, dtype=np.float32)
    encoded = encode_named(Encoding(), 1, 2, {"a/w": data[:6].reshape(2, 3), "a/b": data[6:]}).tobytes()
    packed = Rope([encoded])
    assert packed.varint() == 2 << 3 | 2  # the packed field, then its length
    packed.varint()
    assert packed.first_key() == 1 << 3 | 2  # PackedTensors.data
    for serialized in (packed.joined(), members_first(members, data)):
        for chunk in (3, 10**6):
            rope = Rope([serialized[i : i + chunk] for i in range(0, len(serialized), chunk)])
            got = read_packed_rope(rope)
            assert [(name, value.shape) for name, value in got] == members
            assert np.concatenate([value.ravel() for _, value in got]).tolist() == data.tolist()


def test_a_remembered_layout_still_checks_the_data_and_reads_any_dtype() -> None:
    members = [("m/w", (2, 2)), ("m/b", (2,))]
    assert [v.tolist() for _, v in read_packed_rope(Rope([packed_message(members, np.arange(6.0))]))] == [
        [[0.0, 1.0], [2.0, 3.0]],
        [4.0, 5.0],
    ]
    ints = read_packed_rope(Rope([packed_message(members, np.arange(6, dtype=np.int32))]))
    assert [v.dtype for _, v in ints] == [np.int32, np.int32]
    for data, message in (
        (np.arange(7.0), "'m/w': the members hold 6 elements, the data 7"),
        (np.arange(4.0), "'m/b': shape \\(2,\\) runs past the 4 elements"),
        (np.arange(6.0).reshape(2, 3), "not one dimension"),
    ):
        with pytest.raises(TensorDecodeError, match=message):
            read_packed_rope(Rope([packed_message(members, data)]))


def test_data_given_twice_reads_the_last_in_either_order() -> None:
    members = [("t/a", (2,)), ("t/b", (1,))]
    last = tensor_pb2.PackedTensors(data=to_tensor(np.arange(3.0))).SerializeToString()
    for twice in (packed_message(members, np.zeros(3)) + last, members_first(members, np.zeros(3)) + last):
        assert [v.tolist() for _, v in read_packed_rope(Rope([twice]))] == [[0.0, 1.0], [2.0]]


def test_member_lists_remembered_are_bounded() -> None:
    for i in range(packed.REMEMBERED_LAYOUTS * 2 + 1):
        named = {f"n{i}/a": np.zeros(2, np.float32), f"n{i}/b": np.ones(3, np.float32)}
        encoded = encode_named(Encoding(), 1, 2, named).tobytes()
        rope = Rope([encoded])
        rope.varint()
        rope.varint()
        assert [name for name, _ in read_packed_rope(rope)] == list(named)
        assert len(packed._HEADERS) <= packed.REMEMBERED_LAYOUTS
        assert len(packed._LAYOUTS) <= packed.REMEMBERED_LAYOUTS


def test_members_too_long_to_remember_are_read_each_time() -> None:
    count = packed.REMEMBERED_MEMBERS_BYTES // 40
    names = [f"layer_{i:05d}/a_rather_long_variable_name" for i in range(count)]
    members = [(name, (1,)) for name in names]
    message = packed_message(members, np.arange(len(names), dtype=np.float32))
    packed._LAYOUTS.clear()
    for _ in range(2):
        got = read_packed_rope(Rope([message]))
        assert [name for name, _ in got] == names and got[-1][1].tolist() == [len(names) - 1]
    assert not packed._LAYOUTS
