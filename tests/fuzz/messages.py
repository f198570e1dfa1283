"""Random protobuf requests that follow the messages' structure (fields, nesting, maps, tensors), drawn
from a seeded :class:`random.Random`: the same seed gives the same requests.

Values favour the edges that break servers (0, -1, int64 limits, NaN, empty and long strings, names the job
really uses); ``edl_argo.Tensor`` fields get tensors whose dtype, shape and bytes agree most of the time
(so the request reaches the checks behind decoding) and disagree otherwise. :meth:`MessageFuzzer.mutated`
turns a serialised message into bytes that may not parse at all.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from edl_argo.proto import tensor_pb2

_INT64 = [0, 1, -1, 2, 7, 2**31 - 1, -(2**31), 2**32, 2**62, 2**63 - 1, -(2**63)]
_INT32 = [0, 1, -1, 2, 7, 2**31 - 1, -(2**31)]
_UINT64 = [0, 1, 2, 2**32, 2**63, 2**64 - 1]
_FLOATS = [0.0, 1.0, -1.0, 0.5, 1e-45, 3.4e38, float("nan"), float("inf"), float("-inf")]
_DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
_BAD_DTYPES = ["", "object", "complex64", "float128", "U8", "<f4", "str", "void"]
_ITEMSIZE = {"float16": 2, "float32": 4, "float64": 8, "int8": 1, "int16": 2, "int32": 4, "int64": 8}


class MessageFuzzer:
    """Random messages of any type in the project's protos. ``names``: strings to use often for string
    fields (variable, table and metric names of the running model), besides random ones."""

    def __init__(self, seed: int, names: Sequence[str] = ()) -> None:
        self.rng = random.Random(seed)
        self.names = list(names) or ["x"]

    def message(self, cls: type[Message], depth: int = 0) -> Message:
        message = cls()
        self.fill(message, depth)
        return message

    def fill(self, message: Message, depth: int = 0) -> None:
        descriptor: Descriptor = message.DESCRIPTOR
        if descriptor.full_name == "edl_argo.Tensor":
            message.CopyFrom(self.tensor())
            return
        for field in descriptor.fields:
            if self.rng.random() < 0.3:
                continue
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                self._fill_map(message, field, depth)
            elif field.is_repeated:
                count = self.rng.choice([0, 1, 1, 2, 3, 5]) if depth < 3 else 0
                container = getattr(message, field.name)
                for _ in range(count):
                    if field.type == FieldDescriptor.TYPE_MESSAGE:
                        self.fill(container.add(), depth + 1)
                    else:
                        container.append(self.scalar(field))
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                if depth < 3:
                    self.fill(getattr(message, field.name), depth + 1)
            else:
                setattr(message, field.name, self.scalar(field))

    def _fill_map(self, message: Message, field: FieldDescriptor, depth: int) -> None:
        key_field = field.message_type.fields_by_name["key"]
        value_field = field.message_type.fields_by_name["value"]
        container = getattr(message, field.name)
        for _ in range(self.rng.choice([0, 1, 2]) if depth < 3 else 0):
            key = self.scalar(key_field)
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                self.fill(container[key], depth + 1)
            else:
                container[key] = self.scalar(value_field)

    def scalar(self, field: FieldDescriptor) -> object:
        rng, kind = self.rng, field.type
        if kind in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
            return rng.choice(_INT64) if rng.random() < 0.6 else rng.randint(-1000, 100_000)
        if kind in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
            return rng.choice(_INT32) if rng.random() < 0.6 else rng.randint(-1000, 100_000)
        if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
            return rng.choice(_UINT64)
        if kind in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
            return rng.choice([0, 1, 2**31, 2**32 - 1])
        if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
            value = rng.choice(_FLOATS) if rng.random() < 0.7 else rng.uniform(-1e6, 1e6)
            return (
                struct.unpack("<f", struct.pack("<f", value))[0]
                if kind == FieldDescriptor.TYPE_FLOAT
                else value
            )
        if kind == FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if kind == FieldDescriptor.TYPE_ENUM:
            values = [v.number for v in field.enum_type.values]
            return rng.choice(values) if rng.random() < 0.8 else rng.choice([-1, 99, 2**31 - 1])
        if kind == FieldDescriptor.TYPE_STRING:
            return self.text()
        if kind == FieldDescriptor.TYPE_BYTES:
            return self.blob()
        raise AssertionError(f"field type {kind} of {field.full_name}")

    def text(self) -> str:
        rng = self.rng
        choice = rng.random()
        if choice < 0.5:
            return rng.choice(self.names)
        if choice < 0.6:
            return ""
        if choice < 0.65:
            return "x" * rng.choice([1024, 65_536, 1_000_000])
        if choice < 0.75:
            return rng.choice(
                ["bogus-no-port", "127.0.0.1:0", "[::1]:99999", "host:-1", ":", "a" * 300 + ":1"]
            )
        return "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0x80, 0x2FFF)])) for _ in range(8))

    def blob(self) -> bytes:
        rng = self.rng
        size = rng.choice([0, 1, 7, 64, 4096]) if rng.random() < 0.95 else 1_000_000
        return rng.randbytes(size)

    def tensor(self) -> tensor_pb2.Tensor:
        """A tensor message; its dtype, shape and content agree 70% of the time."""
        rng = self.rng
        name = self.text() if rng.random() < 0.9 else rng.choice(self.names)
        if rng.random() < 0.7:
            dtype = rng.choice(_DTYPES)
            shape = [rng.choice([0, 1, 1, 2, 3, 4, 10, 32]) for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4]))]
            count = 1
            for dim in shape:
                count *= dim
            content = self._content(dtype, count)
            return tensor_pb2.Tensor(name=name, dtype=dtype, shape=shape, content=content)
        dtype = rng.choice(_DTYPES + _BAD_DTYPES)
        rank = rng.choice([0, 1, 2, 3, 65, 200])
        shape = [rng.choice([0, 1, 2, -1, 2**31, 2**40, 2**62, 2**63 - 1, -(2**63)]) for _ in range(rank)]
        return tensor_pb2.Tensor(name=name, dtype=dtype, shape=shape, content=self.blob())

    def _content(self, dtype: str, count: int) -> bytes:
        rng = self.rng
        if dtype == "bool":
            return bytes(rng.choice([0, 1]) for _ in range(count))
        itemsize = _ITEMSIZE.get(dtype, 1)
        if dtype.startswith("float") and rng.random() < 0.5:
            values = [rng.choice(_FLOATS) if rng.random() < 0.2 else rng.uniform(-1, 1) for _ in range(count)]
            return np.array(values).astype(dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes()
        return rng.randbytes(count * itemsize)

    def mutated(self, data: bytes) -> bytes:
        """``data`` with a few random byte edits (flip, drop, insert, truncate, duplicate)."""
        rng, out = self.rng, bytearray(data)
        for _ in range(rng.choice([1, 1, 2, 4])):
            op = rng.randrange(5)
            where = rng.randrange(len(out) + 1)
            if op == 0 and out:
                out[min(where, len(out) - 1)] ^= 1 << rng.randrange(8)
            elif op == 1 and out:
                del out[min(where, len(out) - 1)]
            elif op == 2:
                out[where:where] = rng.randbytes(rng.choice([1, 2, 10]))
            elif op == 3:
                del out[where:]
            else:
                out += out[where:]
        return bytes(out)
