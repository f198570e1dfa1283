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
from edl_argo.rpc.tensors import tensor_array, wire_array

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
#: ``Tensor.content``'s field number.
_CONTENT = tensor_pb2.Tensor.DESCRIPTOR.fields_by_name["content"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def length_prefix(field_number: int, size: int) -> bytes:
    """The key and length of a length-delimited field of ``size`` bytes."""
    return _varint(field_number << 3 | _LENGTH_DELIMITED) + _varint(size)


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

    def string(self, field_number: int, text: str) -> Encoding:
        """Append a string field; returns self."""
        data = text.encode()
        self._add(length_prefix(field_number, len(data)) + data)
        return self

    def tensor(self, field_number: int, array: np.ndarray | object, name: str = "") -> Encoding:
        """Append the ``Tensor`` field ``field_number`` holding ``array`` (checked and converted as
        :func:`~edl_argo.rpc.tensors.fill_tensor` does) without copying its bytes; returns self.

        The array's buffer is read when :meth:`tobytes` runs: it must not change before."""
        value = wire_array(array, name)
        content = memoryview(value.reshape(-1)).cast("B")  # wire_array is C-ordered: a view
        tensor = Encoding(tensor_pb2.Tensor(name=name, dtype=value.dtype.name, shape=value.shape))
        if len(content):  # proto3 leaves an empty field out
            tensor._add(length_prefix(_CONTENT, len(content)))
            tensor._add(content)
        return self.message(field_number, tensor)

    @property
    def pieces(self) -> tuple[bytes | memoryview, ...]:
        """The serialized message in pieces, in order (views of the arrays' buffers among them)."""
        return tuple(self._pieces)

    def tobytes(self) -> bytes:
        """The serialized message."""
        return b"".join(self._pieces)


class WireError(ValueError):
    """Bytes that are not a serialized message."""


def _varint_at(data: memoryview, position: int) -> tuple[int, int]:
    """The varint at ``position`` and the position after it."""
    value = shift = 0
    while position < len(data) and shift < 70:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
    raise WireError("a varint runs past the end of the message or past 10 bytes")


def split_field(data: bytes | memoryview, field_number: int) -> tuple[bytes, list[memoryview]]:
    """The serialized message ``data`` without its length-delimited field ``field_number`` (for protobuf to
    parse), and that field's occurrences in order (views of ``data``)."""
    data = memoryview(data)
    rest: list[memoryview] = []
    taken: list[memoryview] = []
    position = 0
    while position < len(data):
        start = position
        key, position = _varint_at(data, position)
        wire_type = key & 7
        if wire_type == _VARINT:
            _, position = _varint_at(data, position)
        elif wire_type == _FIXED64:
            position += 8
        elif wire_type == _FIXED32:
            position += 4
        elif wire_type == _LENGTH_DELIMITED:
            size, position = _varint_at(data, position)
            position += size
            if position <= len(data) and key >> 3 == field_number:
                taken.append(data[position - size : position])
                continue
        else:
            raise WireError(f"field {key >> 3} has wire type {wire_type}, which no message of ours uses")
        if position > len(data):
            raise WireError(f"field {key >> 3} runs past the end of the message")
        rest.append(data[start:position])
    return b"".join(rest), taken


def read_tensor(data: memoryview) -> tuple[str, np.ndarray]:
    """The name and read-only array of a serialized ``Tensor`` message, viewing ``data`` (no copy).

    Raises :class:`WireError`, or :class:`~edl_argo.rpc.tensors.TensorDecodeError` for fields that do not
    agree (as :func:`~edl_argo.rpc.tensors.from_tensor` does)."""
    rest, contents = split_field(data, _CONTENT)
    try:
        fields = tensor_pb2.Tensor.FromString(rest)
    except Exception as error:  # protobuf's DecodeError
        raise WireError(f"a tensor message does not parse: {error}") from None
    content = contents[-1] if contents else memoryview(b"")  # the last occurrence wins, as in protobuf
    return fields.name, tensor_array(fields.name, fields.dtype, tuple(fields.shape), content)
