"""Named arrays on the wire with the small ones of each dtype packed into one tensor (``PackedTensors``).

Most of a model's variables are small (biases, normalization scales and statistics), and each tensor
message costs tens of microseconds to write and to read in Python, whatever its size: for a ResNet's 37
variables, a few milliseconds of every push and of every answer, on each side. Packed, the small arrays of
one dtype travel as one ``Tensor`` (their elements one after another, each row-major) and a list of
members (name and shape); a large array travels alone, as a ``Tensor`` of its own, since copying it into a
buffer would cost more than its message.

:func:`group_small` is the rule that says which arrays are small, shared with the worker's packed install
(:mod:`edl_argo.model.packing`). :func:`encode_named` writes a mapping of arrays into an
:class:`~edl_argo.rpc.wire.Encoding` as two repeated fields (one of ``Tensor``, one of ``PackedTensors``);
:func:`read_packed_rope` (:func:`read_packed_ropes` for several) and :func:`read_packed` read a
``PackedTensors`` back into named read-only arrays that view one buffer, checked as a ``Tensor`` is
(:func:`~edl_argo.rpc.tensors.tensor_array`): whatever the bytes, they end in arrays or a
:class:`~edl_argo.rpc.tensors.TensorDecodeError` or :class:`~edl_argo.rpc.rope.WireError` that names the
member at fault.

A model's pushes and answers name the same members step after step, and building or reading their
``PackedMember`` messages was most of what packing cost in Python (0.2 ms a group of 37 members, each way,
on each side). The encoder remembers the serialized members of each list it has written and writes the
``data`` first; the reader of a message whose ``data`` comes first remembers where each member lies for
the members' bytes it has seen (at most :data:`REMEMBERED_LAYOUTS` of each, then they start over).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import numpy as np

from edl_argo.proto import tensor_pb2
from edl_argo.rpc.rope import LENGTH_DELIMITED, Rope, WireError, read_tensor_rope, split_rope
from edl_argo.rpc.tensors import TensorDecodeError, element_count, from_tensor, wire_array
from edl_argo.rpc.wire import Encoding

#: Arrays smaller than this travel packed with the others of their dtype; larger ones alone.
SMALL_ARRAY_BYTES = 256 * 1024
#: ``PackedTensors.data``'s field number.
DATA = tensor_pb2.PackedTensors.DESCRIPTOR.fields_by_name["data"].number

#: ``(name, array)`` of each tensor, in the order they came.
NamedArrays = Sequence[tuple[str, np.ndarray]]


def group_small(specs: Sequence[tuple[int, np.dtype]]) -> tuple[dict[np.dtype, list[int]], list[int]]:
    """For arrays of ``(bytes, dtype)``: the indices of the small ones grouped by dtype (groups in order of
    their first member, members in order), and the indices of the large ones, in order."""
    groups: dict[np.dtype, list[int]] = {}
    alone: list[int] = []
    for index, (size, dtype) in enumerate(specs):
        if size < SMALL_ARRAY_BYTES:
            groups.setdefault(np.dtype(dtype), []).append(index)
        else:
            alone.append(index)
    return groups, alone


def encode_named(
    encoding: Encoding, tensor_field: int, packed_field: int, named: Mapping[str, np.ndarray]
) -> Encoding:
    """Append ``named``'s arrays to ``encoding``: the small ones of each dtype as one ``PackedTensors``
    field ``packed_field`` (their bytes copied once, into the packed buffer; its ``data`` first, then its
    members, which :func:`read_packed_rope` reads fastest), every other one as a ``Tensor`` field
    ``tensor_field`` (:meth:`~edl_argo.rpc.wire.Encoding.tensor`); returns ``encoding``. A dtype with a
    single small array sends it alone: packing it would save nothing."""
    items = [(name, wire_array(value, name)) for name, value in named.items()]
    groups, alone = group_small([(value.nbytes, value.dtype) for _, value in items])
    for members in groups.values():
        if len(members) == 1:
            alone.append(members[0])
            continue
        data = np.concatenate([items[i][1].reshape(-1) for i in members])
        header = _serialized_members(tuple((items[i][0], items[i][1].shape) for i in members))
        encoding.message(packed_field, Encoding().tensor(DATA, data).serialized_fields(header))
    for i in sorted(alone):
        encoding.tensor(tensor_field, items[i][1], items[i][0])
    return encoding


def read_packed_rope(rope: Rope) -> NamedArrays:
    """The members of a serialized ``PackedTensors``: views of one read-only buffer of their own (copied
    once from the rope, or the received bytes themselves: :func:`~edl_argo.rpc.rope.read_tensor_rope`).

    A message whose first field is its ``data`` (as :func:`encode_named` and protobuf write it) is read
    as that field, then the members' bytes, whose cut is remembered (:class:`_Layout`): a model's pushes
    and answers name the same members step after step. Any other order is read field by field."""
    if rope.first_key() == DATA << 3 | LENGTH_DELIMITED:
        rope.varint()
        data = rope.split(rope.varint())
        rest = rope.joined()
        _, flat = read_tensor_rope(data)
        key = (rest, flat.itemsize)
        layout = _LAYOUTS.get(key)
        if layout is None:
            fields = _packed_fields(rest)
            if fields.HasField("data"):  # data twice: the last occurrence wins, as in protobuf
                return read_packed(fields)
            layout = _Layout(fields.members, flat.itemsize)
            if len(rest) <= REMEMBERED_MEMBERS_BYTES:
                _remember(_LAYOUTS, key, layout)
        return layout.cut(flat)
    rest, found = split_rope(rope, DATA)
    fields = _packed_fields(rest)
    if not found:
        raise TensorDecodeError(f"packed tensors {_first_name(fields.members)!r}: no data")
    _, flat = read_tensor_rope(found[-1])  # the last occurrence wins, as in protobuf
    return _members(flat, fields.members)


def _packed_fields(data: bytes) -> tensor_pb2.PackedTensors:
    try:
        return tensor_pb2.PackedTensors.FromString(data)
    except Exception as error:  # protobuf's DecodeError
        raise WireError(f"a packed tensor message does not parse: {error}") from None


#: How many member lists :func:`encode_named` and :func:`read_packed_rope` remember (a model's pushes and
#: answers have a few: one per dtype, each way); beyond it they start over.
REMEMBERED_LAYOUTS = 64

#: The largest members' bytes :func:`read_packed_rope` remembers (a request's bytes are the sender's to
#: choose: the memory stays bounded, at most this times :data:`REMEMBERED_LAYOUTS`); a model of about 4,000
#: small variables names them in this much.
REMEMBERED_MEMBERS_BYTES = 256 * 1024

_HEADERS: dict[tuple[tuple[str, tuple[int, ...]], ...], bytes] = {}


def _serialized_members(members: tuple[tuple[str, tuple[int, ...]], ...]) -> bytes:
    """The serialized ``members`` fields of a ``PackedTensors`` of ``(name, shape)`` members (remembered)."""
    header = _HEADERS.get(members)
    if header is None:
        fields = tensor_pb2.PackedTensors(
            members=[tensor_pb2.PackedMember(name=name, shape=shape) for name, shape in members]
        )
        header = _remember(_HEADERS, members, fields.SerializeToString())
    return header


class _Layout:
    """Where each member of a ``PackedTensors`` lies in data of ``itemsize``-byte elements: ``(name, start,
    end, shape)`` in elements, and the elements they hold together. Members whose shapes no such array can
    have are a :class:`~edl_argo.rpc.tensors.TensorDecodeError` naming the member."""

    def __init__(self, members: Sequence[tensor_pb2.PackedMember], itemsize: int) -> None:
        self.first_name = _first_name(members)
        self.cuts: list[tuple[str, int, int, tuple[int, ...]]] = []
        offset = 0
        for member in members:
            shape = tuple(member.shape)
            end = offset + element_count(member.name, shape, itemsize)
            self.cuts.append((member.name, offset, end, shape))
            offset = end
        self.size = offset

    def cut(self, flat: np.ndarray) -> NamedArrays:
        """``flat`` cut into the members (views); they must use every element of it, and nothing more: a
        :class:`~edl_argo.rpc.tensors.TensorDecodeError` names the member at fault otherwise."""
        if flat.ndim != 1:
            raise TensorDecodeError(
                f"packed tensors {self.first_name!r}: the data has shape {flat.shape}, not one dimension"
            )
        if flat.size != self.size:
            for name, _, end, shape in self.cuts:
                if end > flat.size:
                    raise TensorDecodeError(
                        f"tensor {name!r}: shape {shape} runs past the {flat.size} elements of its packed"
                        " data"
                    )
            raise TensorDecodeError(
                f"packed tensors {self.first_name!r}: the members hold {self.size} elements, the data"
                f" {flat.size}"
            )
        return [(name, flat[start:end].reshape(shape)) for name, start, end, shape in self.cuts]


_LAYOUTS: dict[tuple[bytes, int], _Layout] = {}

K = TypeVar("K")
V = TypeVar("V")


def _remember(memory: dict[K, V], key: K, value: V) -> V:
    """``memory[key] = value``, the memory emptied first when it holds :data:`REMEMBERED_LAYOUTS`; returns
    ``value``."""
    if len(memory) >= REMEMBERED_LAYOUTS:
        memory.clear()
    memory[key] = value
    return value


def read_packed_ropes(groups: Sequence[Rope]) -> NamedArrays:
    """The members of every serialized ``PackedTensors`` of ``groups`` (a message's occurrences of one
    repeated field), in order (:func:`read_packed_rope`)."""
    return [pair for group in groups for pair in read_packed_rope(group)]


def read_packed(message: tensor_pb2.PackedTensors) -> NamedArrays:
    """The members of a parsed ``PackedTensors`` (views of its bytes; see :func:`read_packed_rope`)."""
    if not message.HasField("data"):
        raise TensorDecodeError(f"packed tensors {_first_name(message.members)!r}: no data")
    return _members(from_tensor(message.data), message.members)


def read_all(tensors: Sequence[tensor_pb2.Tensor], packed: Sequence[tensor_pb2.PackedTensors]) -> NamedArrays:
    """The arrays of a parsed message's two repeated fields that :func:`encode_named` wrote (views of its
    bytes): the packed ones first, in order, then the others."""
    unpacked = [pair for group in packed for pair in read_packed(group)]
    return unpacked + [(t.name, from_tensor(t)) for t in tensors]


def _first_name(members: Sequence[tensor_pb2.PackedMember]) -> str:
    return members[0].name if members else ""


def _members(flat: np.ndarray, members: Sequence[tensor_pb2.PackedMember]) -> NamedArrays:
    """Cut ``flat`` into ``members`` (:meth:`_Layout.cut`)."""
    return _Layout(members, flat.itemsize).cut(flat)
