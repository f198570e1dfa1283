"""Messages that carry large tensors, encoded with each tensor's bytes copied once.

Building a protobuf message copies a tensor's bytes three times before gRPC sees them (``tobytes``, into the
message, ``SerializeToString``): for a model of a few megabytes, most of a push's encoding time. An
:class:`Encoding` instead collects the serialized message as a list of pieces: the small fields serialized by
protobuf itself, and each tensor's ``content`` as a view of the array's buffer. :meth:`Encoding.tobytes`
joins them, which is the only copy. The result is the protobuf encoding of the same message (fields in
another order, which the wire format allows): any protobuf parser reads it back as the message
:func:`edl_argo.rpc.tensors.fill_tensor` would have built.

Decoding, the other way round, copies nothing: :func:`split_field` takes the occurrences of one field out
of a serialized message (views of its bytes) and leaves the rest to protobuf, and :func:`read_tensor`
makes a ``Tensor`` field an array viewing the message's bytes. Whatever the bytes, they end in an array,
a message or a :class:`WireError`.
"""

from __future__ import annotations

import numpy as np
from google.protobuf.message import Message

from edl_argo.proto import tensor_pb2
from edl_argo.rpc.rope import (
    CONTENT,
    LENGTH_DELIMITED,
    SMALL_TENSOR_BYTES,
    Rope,
    WireError,
    split_rope,
    tensor_fields,
    varint_bytes,
)
from edl_argo.rpc.tensors import tensor_array, wire_array

__all__ = ["Encoding", "WireError", "length_prefix", "read_tensor", "split_field"]


def length_prefix(field_number: int, size: int) -> bytes:
    """The key and length of a length-delimited field of ``size`` bytes."""
    return varint_bytes(field_number << 3 | LENGTH_DELIMITED) + varint_bytes(size)


def serialized(message: bytes | Encoding | Message) -> bytes | Encoding:
    """``message`` as bytes to send: a message serialized, bytes and an :class:`Encoding` as they are."""
    return message if isinstance(message, bytes | Encoding) else message.SerializeToString()


class Encoding:
    """A serialized message under construction: pieces in order, and their total size in bytes."""

    def __init__(self, fields: Message | None = None) -> None:
        """Start with ``fields``' own serialization (its small fields), if given."""
        self._pieces: list[bytes | memoryview] = []
        self.size = 0
        if fields is not None:
            self._add(fields.SerializeToString())

    def _add(self, piece: bytes | memoryview) -> None:
        self._pieces.append(piece)
        self.size += len(piece)

    def message(self, field_number: int, inner: Encoding) -> Encoding:
        """Append ``inner`` as the (sub-)message field ``field_number``; returns self."""
        self._add(length_prefix(field_number, inner.size))
        self._pieces.extend(inner._pieces)
        self.size += inner.size
        return self

    def serialized_fields(self, data: bytes) -> Encoding:
        """Append fields serialized already (``SerializeToString`` of a message of the same type); returns
        self."""
        self._add(data)
        return self

    def string(self, field_number: int, text: str) -> Encoding:
        """Append a string field; returns self."""
        data = text.encode()
        self._add(length_prefix(field_number, len(data)) + data)
        return self

    def tensor(self, field_number: int, array: np.ndarray | object, name: str = "") -> Encoding:
        """Append the ``Tensor`` field ``field_number`` holding ``array`` (checked and converted as
        :func:`~edl_argo.rpc.tensors.fill_tensor` does); returns self. A small array
        (:data:`~edl_argo.rpc.rope.SMALL_TENSOR_BYTES`) is copied into one piece with its fields; a larger
        one's bytes are not copied, and its buffer is read when :meth:`tobytes` runs: it must not change
        before."""
        value = wire_array(array, name)
        if value.nbytes < SMALL_TENSOR_BYTES:  # one piece, content copied: a third of the time
            fields = tensor_pb2.Tensor(
                name=name, dtype=value.dtype.name, shape=value.shape, content=value.tobytes()
            )
            data = fields.SerializeToString()
            self._add(length_prefix(field_number, len(data)) + data)
            return self
        content = memoryview(value.reshape(-1)).cast("B")  # wire_array is C-ordered: a view
        tensor = Encoding(tensor_pb2.Tensor(name=name, dtype=value.dtype.name, shape=value.shape))
        if len(content):  # proto3 leaves an empty field out
            tensor._add(length_prefix(CONTENT, len(content)))
            tensor._add(content)
        return self.message(field_number, tensor)

    @property
    def pieces(self) -> tuple[bytes | memoryview, ...]:
        """The serialized message in pieces, in order (views of the arrays' buffers among them)."""
        return tuple(self._pieces)

    def tobytes(self) -> bytes:
        """The serialized message."""
        return b"".join(self._pieces)


def split_field(data: bytes | memoryview, field_number: int) -> tuple[bytes, list[memoryview]]:
    """The serialized message ``data`` without its length-delimited field ``field_number`` (for protobuf to
    parse), and that field's occurrences in order (views of ``data``): :func:`~edl_argo.rpc.rope.split_rope`
    of one piece."""
    rest, taken = split_rope(Rope([data]), field_number)
    return rest, [occurrence.take(len(occurrence)) for occurrence in taken]


def read_tensor(data: memoryview) -> tuple[str, np.ndarray]:
    """The name and read-only array of a serialized ``Tensor`` message, viewing ``data`` (no copy).

    Raises :class:`WireError`, or :class:`~edl_argo.rpc.tensors.TensorDecodeError` for fields that do not
    agree (as :func:`~edl_argo.rpc.tensors.from_tensor` does)."""
    rest, contents = split_field(data, CONTENT)
    fields = tensor_fields(rest)
    content = contents[-1] if contents else memoryview(b"")  # the last occurrence wins, as in protobuf
    return fields.name, tensor_array(fields.name, fields.dtype, tuple(fields.shape), content)
