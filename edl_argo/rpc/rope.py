"""A serialized message as the chunks it arrived in, read without joining them.

A large message received in chunks (:mod:`edl_argo.rpc.chunked`) is mostly tensors. Joining the chunks
copies every byte once, and TensorFlow copies a numpy array once more into a tensor. A :class:`Rope` is the
chunks' bytes in order, read front to back: :func:`split_rope` takes the occurrences of one field out of a
message (as :func:`edl_argo.rpc.wire.split_field` does for contiguous bytes), and :func:`read_tensor_rope`
copies a ``Tensor``'s content straight from the chunks into aligned memory of its own, the only copy of its
bytes, which :func:`as_tf_tensor` then hands to TensorFlow without another (``tf.experimental.dlpack``).
The reading of contiguous bytes (:func:`edl_argo.rpc.wire.split_field`) is this reading of one piece.

Whatever the bytes, they end in arrays, messages or a :class:`WireError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from edl_argo.proto import tensor_pb2
from edl_argo.rpc.tensors import tensor_array

if TYPE_CHECKING:
    import tensorflow as tf

#: Where an array's data starts, in bytes: what TensorFlow's and XLA's CPU kernels assume of a tensor.
ALIGNMENT = 64

#: A tensor up to this size (its serialized ``Tensor``) is written and read by protobuf whole, its content
#: copied: up to about this size a copy costs less than handling the content apart in Python
#: (:meth:`~edl_argo.rpc.wire.Encoding.tensor`, :func:`read_tensor_rope`).
SMALL_TENSOR_BYTES = 64 * 1024
#: What a ``Tensor``'s fields other than its content take at most, in bytes, for the tensors a model names
#: (name, dtype and shape, with their keys and lengths): a tensor whose content is under
#: :data:`SMALL_TENSOR_BYTES` is written whole, and read whole when its message is under both.
TENSOR_FIELDS_BYTES = 1024
#: Protobuf's wire types (those of our messages).
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5
#: ``Tensor.content``'s field number.
CONTENT = tensor_pb2.Tensor.DESCRIPTOR.fields_by_name["content"].number


class WireError(ValueError):
    """Bytes that are not a serialized message."""


def varint_bytes(value: int) -> bytes:
    """``value`` (>= 0) encoded as a protobuf varint."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


class Rope:
    """Bytes in pieces (``parts``, views), read front to back."""

    def __init__(self, parts: Sequence[bytes | memoryview]) -> None:
        self._parts = [memoryview(part) for part in parts if len(part)]
        self._index = 0  # the part being read
        self._offset = 0  # in that part
        self.remaining = sum(len(part) for part in self._parts)

    def __len__(self) -> int:
        return self.remaining

    def joined(self) -> bytes:
        """Everything not read yet, joined (and read)."""
        return self.take(self.remaining).tobytes() if self.remaining else b""

    def _byte(self) -> int:
        if not self.remaining:
            raise WireError("a varint runs past the end of the message")
        part = self._parts[self._index]
        value = part[self._offset]
        self._advance(1)
        return value

    def _advance(self, size: int) -> None:
        self.remaining -= size
        self._offset += size
        while self._index < len(self._parts) and self._offset >= len(self._parts[self._index]):
            self._offset -= len(self._parts[self._index])
            self._index += 1

    def varint(self) -> int:
        """The varint at the front."""
        value = shift = 0
        while shift < 70:
            byte = self._byte()
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
        raise WireError("a varint runs past 10 bytes")

    def first_key(self) -> int | None:
        """The varint at the front (a field's key), or None when there is none; reads nothing."""
        place = self._index, self._offset, self.remaining
        try:
            return self.varint()
        except WireError:
            return None
        finally:
            self._index, self._offset, self.remaining = place

    def split(self, size: int) -> Rope:
        """The next ``size`` bytes as a rope of their own (views; nothing is copied)."""
        if size > self.remaining:
            raise WireError("a field runs past the end of the message")
        pieces: list[memoryview] = []
        wanted = size
        while wanted:
            part = self._parts[self._index]
            piece = part[self._offset : self._offset + wanted]
            pieces.append(piece)
            wanted -= len(piece)
            self._advance(len(piece))
        return Rope(pieces)

    def take(self, size: int) -> memoryview:
        """The next ``size`` bytes: a view when they lie in one part, else joined."""
        parts = self.split(size)._parts
        if len(parts) == 1:
            return parts[0]
        return memoryview(b"".join(parts))

    def sole_part(self) -> memoryview | None:
        """Everything not read yet, as a view, when it lies in one part; else None. Reads nothing."""
        if not self.remaining or self.remaining > len(self._parts[self._index]) - self._offset:
            return None
        return self._parts[self._index][self._offset : self._offset + self.remaining]

    def copy_into(self, destination: memoryview) -> None:
        """Fill ``destination`` (writable bytes) with the next ``len(destination)`` bytes."""
        filled = 0
        for piece in self.split(len(destination))._parts:
            destination[filled : filled + len(piece)] = piece
            filled += len(piece)


def merged(occurrences: Sequence[Rope]) -> Rope:
    """The occurrences of one message field as the one message protobuf reads them as (their
    concatenation: occurrences of a message field merge)."""
    return occurrences[0] if len(occurrences) == 1 else Rope([rope.joined() for rope in occurrences])


def split_rope(rope: Rope, field_number: int) -> tuple[bytes, list[Rope]]:
    """The message ``rope`` holds without its length-delimited field ``field_number`` (for protobuf to
    parse), and that field's occurrences in order; reads all of ``rope``."""
    rest, taken = split_rope_fields(rope, (field_number,))
    return rest, taken[field_number]


def split_rope_fields(rope: Rope, field_numbers: Sequence[int]) -> tuple[bytes, dict[int, list[Rope]]]:
    """:func:`split_rope` of several length-delimited fields at once: the rest, and the occurrences of each
    field by its number (every number a key)."""
    rest: list[bytes | memoryview] = []
    taken: dict[int, list[Rope]] = {number: [] for number in field_numbers}
    while rope.remaining:
        key = rope.varint()
        head = varint_bytes(key)
        wire_type = key & 7
        if wire_type == VARINT:
            rest += [head, varint_bytes(rope.varint())]
        elif wire_type in (FIXED64, FIXED32):
            rest += [head, rope.take(8 if wire_type == FIXED64 else 4)]
        elif wire_type == LENGTH_DELIMITED:
            size = rope.varint()
            if key >> 3 in taken:
                taken[key >> 3].append(rope.split(size))
            else:
                rest += [head, varint_bytes(size), rope.take(size)]
        else:
            raise WireError(f"field {key >> 3} has wire type {wire_type}, which no message of ours uses")
    return b"".join(rest), taken


def aligned_empty(size: int) -> memoryview:
    """``size`` new writable bytes whose start is aligned to :data:`ALIGNMENT`."""
    raw = np.empty(size + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return memoryview(raw[start : start + size])


def tensor_fields(rest: bytes | memoryview) -> tensor_pb2.Tensor:
    """A serialized ``Tensor`` without its ``content`` (name, dtype, shape) as a message; a
    :class:`WireError` for bytes that are no such message."""
    try:
        return tensor_pb2.Tensor.FromString(rest)
    except Exception as error:  # protobuf's DecodeError
        raise WireError(f"a tensor message does not parse: {error}") from None


def read_tensor_rope(rope: Rope) -> tuple[str, np.ndarray]:
    """The name and read-only array of a serialized ``Tensor`` whose content lies in aligned memory of its
    own, which :func:`as_tf_tensor` can share with TensorFlow: the received bytes themselves when they
    are one writable, aligned part (the tensor port receives a tensor's content so:
    :mod:`edl_argo.rpc.tensor_port`), else a copy. Raises :class:`WireError`, or
    :class:`~edl_argo.rpc.tensors.TensorDecodeError` for fields that do not agree.

    A message in one piece of at most :data:`SMALL_TENSOR_BYTES` plus :data:`TENSOR_FIELDS_BYTES` (what
    :meth:`~edl_argo.rpc.wire.Encoding.tensor` writes whole) is parsed by protobuf whole, its content then
    copied: a third of the time of reading it here field by field (most of a model's tensors are such:
    biases, normalization scales and statistics)."""
    whole = rope.sole_part()
    if whole is not None and len(whole) <= SMALL_TENSOR_BYTES + TENSOR_FIELDS_BYTES:
        fields = tensor_fields(whole)
        buffer = aligned_empty(len(fields.content))
        buffer[:] = fields.content
        return fields.name, tensor_array(fields.name, fields.dtype, tuple(fields.shape), buffer)
    rest, contents = split_rope(rope, CONTENT)
    fields = tensor_fields(rest)
    content = contents[-1] if contents else Rope([])  # the last occurrence wins, as in protobuf
    buffer = content.sole_part()
    if buffer is None or buffer.readonly or np.frombuffer(buffer, np.uint8).ctypes.data % ALIGNMENT:
        buffer = aligned_empty(len(content))
        content.copy_into(buffer)  # else the content stays unread: nothing reads this rope again
    return fields.name, tensor_array(fields.name, fields.dtype, tuple(fields.shape), buffer)


def as_tf_tensor(array: np.ndarray) -> tf.Tensor:
    """``array``, which its caller gives away (it is not read or changed afterwards), as a TensorFlow
    tensor: sharing its memory when that memory is writable underneath, C-ordered and aligned (the arrays
    of :func:`read_tensor_rope`), else a copy."""
    import tensorflow as tf

    if (
        array.size
        and array.flags.c_contiguous
        and array.ctypes.data % ALIGNMENT == 0
        and array.dtype.kind in "fiu"
    ):
        shared = array.view()
        try:
            shared.flags.writeable = True  # DLPack exports writable memory only
        except ValueError:  # read-only underneath (a bytes object)
            return tf.convert_to_tensor(array)
        return tf.experimental.dlpack.from_dlpack(shared.__dlpack__())
    return tf.convert_to_tensor(array)
