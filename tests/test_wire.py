"""Pushes encoded piece by piece (edl_argo.rpc.wire) are the messages protobuf builds from the same values;
replies read without copies are the messages protobuf reads, and damaged ones fail with a decoding error."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import tensorflow as tf
from google.protobuf.message import DecodeError

from edl_argo.proto import ps_pb2, tensor_pb2
from edl_argo.ps.pushed import PushedModel
from edl_argo.rpc import rope
from edl_argo.rpc.rope import (
    ALIGNMENT,
    SMALL_TENSOR_BYTES,
    Rope,
    aligned_empty,
    as_tf_tensor,
    read_tensor_rope,
)
from edl_argo.rpc.tensors import TensorDecodeError, fill_tensor
from edl_argo.rpc.wire import Encoding, WireError, read_tensor, split_field
from edl_argo.worker.ps_client import PushReply, push_request

RNG = np.random.default_rng(7)

ARRAYS = {
    "matrix": RNG.normal(size=(33, 7)).astype(np.float32),
    "half": RNG.normal(size=(5,)).astype(np.float16),
    "flags": np.array([True, False, True]),
    "scalar": np.float64(2.5),
    "empty": np.zeros((0, 3), np.float32),
    "columns": RNG.normal(size=(6, 8)).astype(np.float32)[:, ::2],  # not contiguous
    "big_endian": np.arange(4, dtype=">f8"),
    "eager": tf.constant(RNG.normal(size=(4, 4)).astype(np.float32)),
    "large": RNG.normal(size=(300, 200)).astype(np.float32),  # lengths of 3-byte varints
}


def reference_push(
    fields: ps_pb2.PushGradientsRequest,
    dense: dict[str, object],
    state: dict[str, object],
    sparse: dict[str, tuple[np.ndarray, np.ndarray]],
) -> ps_pb2.PushGradientsRequest:
    """The request as protobuf builds it from the same values."""
    request = ps_pb2.PushGradientsRequest()
    request.CopyFrom(fields)
    request.gradients.version = fields.version
    for name, value in dense.items():
        fill_tensor(request.gradients.dense_parameters.add(), value, name)
    for name, value in state.items():
        fill_tensor(request.gradients.non_trainable_parameters.add(), value, name)
    for table, (values, ids) in sparse.items():
        fill_tensor(request.gradients.embedding_tables[table].values, values, table)
        fill_tensor(request.gradients.embedding_tables[table].ids, np.asarray(ids, np.int64), table)
    return request


def test_a_push_encoded_piece_by_piece_parses_as_the_message_protobuf_builds() -> None:
    fields = ps_pb2.PushGradientsRequest(
        version=41,
        learning_rate_scale=0.5,
        authority_step=3,
        examples=64,
        return_parameters=True,
        pusher_id="a" * 200,  # a length of two varint bytes
        sequence=2**40,
    )
    dense = {f"layer/{name}": value for name, value in ARRAYS.items()}
    state = {"norm/moving_mean": RNG.normal(size=(7,)).astype(np.float32)}
    sparse = {
        "users": (RNG.normal(size=(3, 4)).astype(np.float32), np.array([9, 2, 2**33])),
        "items": (np.zeros((0, 4), np.float32), np.zeros(0, np.int64)),
    }
    encoded = push_request(fields, dense, state, sparse).tobytes()
    parsed = ps_pb2.PushGradientsRequest.FromString(encoded)
    assert len(encoded) == parsed.ByteSize()  # nothing more on the wire than protobuf would send
    reference = reference_push(fields, dense, state, sparse)
    # The small dense tensors travel packed (edl_argo.rpc.packed): the same arrays by name, and every
    # other field as protobuf builds it.
    assert len(parsed.gradients.packed_dense_parameters) == 2  # float32 and float64; the rest alone
    decoded = PushedModel.of_message(parsed.gradients)
    expected = PushedModel.of_message(reference.gradients)
    for got, want in ((decoded.dense, expected.dense), (decoded.non_trainable, expected.non_trainable)):
        assert sorted(name for name, _ in got) == sorted(name for name, _ in want)
        wanted = dict(want)
        for name, value in got:
            assert value.dtype == wanted[name].dtype and value.shape == wanted[name].shape
            assert value.tobytes() == wanted[name].tobytes()
    for message in (parsed, reference):
        for field in ("dense_parameters", "packed_dense_parameters", "non_trainable_parameters"):
            message.gradients.ClearField(field)
    assert parsed == reference


def test_an_empty_push_is_the_fields_alone() -> None:
    fields = ps_pb2.PushGradientsRequest(version=0, pusher_id="w", sequence=1)
    parsed = ps_pb2.PushGradientsRequest.FromString(push_request(fields, {}, {}, {}).tobytes())
    assert parsed == reference_push(fields, {}, {}, {})


def test_strings_and_messages_nest_at_every_length() -> None:
    for size in (0, 1, 127, 128, 16_383, 16_384, 70_000):
        text = "é" * (size // 2) + "x" * (size % 2)  # multi-byte characters: the length is in bytes
        inner = Encoding(ps_pb2.PushModelResponse(version=size)).string(1, text)
        outer = Encoding().message(2, inner)
        entry = ps_pb2.PushGradientsRequest.FromString(Encoding().message(1, outer).tobytes())
        assert entry.gradients.embedding_tables[text].values.name == ""


def test_a_dtype_that_cannot_travel_is_refused_naming_the_tensor() -> None:
    with pytest.raises(TypeError, match="'dense/strings'"):
        Encoding().tensor(2, np.array(["a"]), "dense/strings")


def answer_message(values: dict[str, np.ndarray], synced_step: int) -> ps_pb2.PullDenseParametersResponse:
    answer = ps_pb2.PullDenseParametersResponse(
        initialized=True, version=12, synced_step=synced_step, synchronous=True
    )
    for name, value in values.items():
        fill_tensor(answer.dense_parameters.add(), value, name)
    return answer


@pytest.mark.parametrize("chunk_bytes", [7, 1000, 10**9])
def test_a_reply_is_read_from_its_chunks_as_protobuf_reads_it_each_tensor_copied_once_aligned(
    chunk_bytes: int,
) -> None:
    values = {"w": ARRAYS["large"], "b": ARRAYS["half"], "s": np.asarray(ARRAYS["scalar"])}
    reply = ps_pb2.PushGradientsResponse(accepted=True, version=12, step=-3)
    reply.parameters.CopyFrom(answer_message(values, synced_step=-1))  # negative: 10-byte varints
    data = reply.SerializeToString()
    parts = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)]  # fields span chunks
    parsed = PushReply.parse(Rope(parts))
    assert (parsed.accepted, parsed.version, parsed.step) == (True, 12, -3)
    carried = parsed.parameters
    assert (carried.initialized, carried.version, carried.synced_step, carried.synchronous) == (
        True,
        12,
        -1,
        True,
    )
    assert sorted(carried.values) == sorted(values)
    for name, value in values.items():
        assert np.array_equal(carried.values[name], value) and carried.values[name].dtype == value.dtype
        assert not carried.values[name].flags.writeable
        assert carried.values[name].ctypes.data % ALIGNMENT == 0
        assert not any(
            np.shares_memory(carried.values[name], np.frombuffer(part, np.uint8)) for part in parts
        )
    empty = PushReply.parse(
        Rope([ps_pb2.PushGradientsResponse(accepted=False, version=3).SerializeToString()])
    )
    assert not empty.accepted and not empty.parameters.initialized and empty.parameters.values == {}


def test_an_array_given_to_tensorflow_shares_its_memory_only_when_that_memory_is_writable_underneath() -> (
    None
):
    class Exported:
        """A tensor's memory as numpy takes it (TensorFlow hands out a bare DLPack capsule)."""

        def __init__(self, tensor: tf.Tensor) -> None:
            self.capsule = tf.experimental.dlpack.to_dlpack(tensor)

        def __dlpack__(self, **_: object) -> object:
            return self.capsule

        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)  # CPU

    def memory_of(tensor: tf.Tensor) -> np.ndarray:
        return np.from_dlpack(Exported(tensor))

    message = fill_tensor(tensor_pb2.Tensor(), ARRAYS["large"], "w").SerializeToString()
    _, received = read_tensor_rope(Rope([message]))
    shared = memory_of(as_tf_tensor(received))
    assert np.shares_memory(shared, received) and np.array_equal(shared, ARRAYS["large"])
    viewed = np.frombuffer(ARRAYS["large"].tobytes(), ARRAYS["large"].dtype)  # read-only bytes underneath
    copied = memory_of(as_tf_tensor(viewed))
    assert not np.shares_memory(copied, viewed) and np.array_equal(copied, viewed)


def test_split_field_leaves_protobuf_the_rest_and_keeps_every_occurrence_in_order() -> None:
    answer = answer_message({"a": ARRAYS["matrix"], "b": ARRAYS["flags"]}, synced_step=5)
    rest, tensors = split_field(answer.SerializeToString(), 3)
    without = ps_pb2.PullDenseParametersResponse()
    without.CopyFrom(answer)
    del without.dense_parameters[:]
    assert ps_pb2.PullDenseParametersResponse.FromString(rest) == without
    assert [read_tensor(t)[0] for t in tensors] == ["a", "b"]


def decoding_errors(data: bytes, parse: Callable[[Rope], object], rng: np.random.Generator) -> int:
    """How many of the damaged copies of ``data`` (every truncation, and 300 with 3 bytes flipped at random)
    ``parse`` (reading each from two chunks, so that fields span them) refuses with an error protobuf, the
    wire reader or the tensor checks name; any other exception propagates."""
    damaged = [data[:cut] for cut in range(len(data))]
    for _ in range(300):
        flipped = bytearray(data)
        for position in rng.integers(0, len(data), size=3):
            flipped[position] = rng.integers(0, 256)
        damaged.append(bytes(flipped))
    errors = 0
    for candidate in damaged:
        try:
            middle = len(candidate) // 2
            parse(Rope([candidate[:middle], candidate[middle:]]))
        except (WireError, TensorDecodeError, DecodeError):
            errors += 1
    return errors


def test_damaged_replies_fail_with_a_decoding_error_and_nothing_else() -> None:
    """Every truncation, and bytes flipped at random, of a reply: an error protobuf, the wire reader or the
    tensor checks name, or (when the damage keeps it a valid message) an answer; never another exception."""
    reply = ps_pb2.PushGradientsResponse(accepted=True, version=4)
    reply.parameters.CopyFrom(answer_message({"w": ARRAYS["matrix"], "b": ARRAYS["half"]}, synced_step=2))
    data = reply.SerializeToString()
    assert decoding_errors(data, PushReply.parse, RNG) > len(data) // 2  # most truncations cut a tensor short


def test_wire_types_no_message_of_ours_uses_are_refused() -> None:
    with pytest.raises(WireError, match="wire type 3"):
        split_field(bytes([1 << 3 | 3]), 2)
    with pytest.raises(WireError, match="varint"):
        split_field(bytes([0x08] + [0xFF] * 11), 2)
    with pytest.raises(WireError, match="past the end"):
        split_field(bytes([2 << 3 | 2, 5, 1]), 2)


def test_a_content_received_in_aligned_memory_of_its_own_is_read_in_place_else_copied() -> None:
    """The tensor port receives a tensor's content into aligned memory of its own: its array is that
    memory (no copy). Content that is read-only, unaligned or in several parts is copied, aligned."""
    value = ARRAYS["large"]
    message = fill_tensor(tensor_pb2.Tensor(), value, "w").SerializeToString()
    start = len(message) - value.nbytes  # the content is the message's last field
    own = aligned_empty(value.nbytes)
    own[:] = message[start:]
    _, in_place = read_tensor_rope(Rope([message[:start], own]))
    assert np.array_equal(in_place, value) and np.shares_memory(in_place, np.frombuffer(own, np.uint8))
    unaligned = memoryview(np.empty(value.nbytes + 1, np.uint8))[1:]
    unaligned[:] = message[start:]
    halves = [own[: value.nbytes // 2], own[value.nbytes // 2 :]]
    for parts in (
        [message[:start], unaligned],
        [message[:start], message[start:]],
        [message[:start], *halves],
    ):
        _, copied = read_tensor_rope(Rope(parts))
        assert np.array_equal(copied, value) and copied.ctypes.data % ALIGNMENT == 0
        assert not any(np.shares_memory(copied, np.frombuffer(part, np.uint8)) for part in parts)


def test_a_tensor_written_whole_is_read_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's bound (the content) and the reader's (the message) agree: a tensor just under the bound,
    with a long name, is read by protobuf whole, never field by field."""
    value = np.arange(SMALL_TENSOR_BYTES // 4 - 1, dtype=np.float32)
    name = "model/block_7/multi_head_attention/key/kernel" * 4
    pieces = Encoding().tensor(1, value, name).pieces
    assert len(pieces) == 1  # written whole
    _, [occurrence] = split_field(pieces[0], 1)

    def field_by_field(*_: object) -> None:
        raise AssertionError("read field by field")

    monkeypatch.setattr(rope, "split_rope", field_by_field)
    read_name, array = read_tensor_rope(Rope([occurrence]))
    assert read_name == name and np.array_equal(array, value)
