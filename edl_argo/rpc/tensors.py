"""Tensors on the wire: numpy arrays <-> ``edl_argo.Tensor`` messages as raw bytes with dtype and shape."""

from __future__ import annotations

import math

import numpy as np

from edl_argo.proto import tensor_pb2

#: dtypes a tensor message may carry; anything else is rejected (a malformed or hostile request).
ALLOWED_DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"}
)

#: The dtypes of :data:`ALLOWED_DTYPES`, little-endian: an array of one of them travels as it is (comparing
#: dtypes is cheaper than reading their names, which numpy builds in Python).
_WIRE_DTYPES = frozenset(np.dtype(name).newbyteorder("<") for name in ALLOWED_DTYPES)

#: The most dimensions a tensor message may have (numpy's limit).
MAX_DIMENSIONS = 64


class TensorDecodeError(ValueError):
    """A tensor message whose dtype, shape and content do not agree."""


def to_tensor(array: np.ndarray | object, name: str = "") -> tensor_pb2.Tensor:
    """Encode an array (or anything ``np.asarray`` takes, including eager TF tensors) as a message."""
    return fill_tensor(tensor_pb2.Tensor(), array, name)


def fill_tensor(message: tensor_pb2.Tensor, array: np.ndarray | object, name: str = "") -> tensor_pb2.Tensor:
    """Encode ``array`` into ``message`` in place and return it.

    Filling a field of the message being built (``request.tensors.add()``) instead of building a tensor and
    copying it in saves a copy of the bytes per level of nesting: megabytes per push for a dense model.
    """
    value = wire_array(array, name)
    message.name = name
    message.dtype = value.dtype.name
    message.shape[:] = value.shape
    message.content = value.tobytes()
    return message


def wire_array(array: np.ndarray | object, name: str = "") -> np.ndarray:
    """``array`` as a C-ordered little-endian array of a dtype that may travel (a view when it already is
    one); TypeError for any other dtype."""
    value = np.asarray(array, order="C")  # not ascontiguousarray: it turns a scalar into shape (1,)
    if value.dtype in _WIRE_DTYPES:
        return value
    if value.dtype.name not in ALLOWED_DTYPES:
        raise TypeError(f"tensor {name!r}: dtype {value.dtype} cannot travel on the wire")
    if value.dtype.byteorder == ">":
        value = value.astype(value.dtype.newbyteorder("<"))
    return value


def from_tensor(message: tensor_pb2.Tensor) -> np.ndarray:
    """Decode a message into a read-only numpy array viewing its bytes (no copy).

    Raises :class:`TensorDecodeError` when the dtype is unknown or the byte count does not match the shape.
    """
    return tensor_array(message.name, message.dtype, tuple(message.shape), message.content)


def tensor_array(
    name: str, dtype_name: str, shape: tuple[int, ...], content: bytes | memoryview
) -> np.ndarray:
    """The read-only array of a tensor message's fields, viewing ``content`` (no copy); see
    :func:`from_tensor`."""
    dtype = wire_dtype(name, dtype_name)
    expected = element_count(name, shape, dtype.itemsize) * dtype.itemsize
    if expected != len(content):
        raise TensorDecodeError(
            f"tensor {name!r}: shape {shape} of {dtype_name} needs {expected} bytes, got {len(content)}"
        )
    array = np.frombuffer(content, dtype=dtype).reshape(shape)
    array.flags.writeable = False
    return array


def wire_dtype(name: str, dtype_name: str) -> np.dtype:
    """The little-endian dtype a tensor message names; :class:`TensorDecodeError` for one that may not
    travel (``name``: the tensor's, for the error)."""
    if dtype_name not in ALLOWED_DTYPES:
        raise TensorDecodeError(f"tensor {name!r}: unsupported dtype {dtype_name!r}")
    return np.dtype(dtype_name).newbyteorder("<")


def element_count(name: str, shape: tuple[int, ...], itemsize: int) -> int:
    """The number of elements of a tensor message's ``shape``; :class:`TensorDecodeError` when the shape
    is not one an array of ``itemsize``-byte elements can have."""
    if len(shape) > MAX_DIMENSIONS:
        raise TensorDecodeError(f"tensor {name!r}: {len(shape)} dimensions, at most {MAX_DIMENSIONS}")
    if any(d < 0 for d in shape):
        raise TensorDecodeError(f"tensor {name!r}: negative dimension in shape {shape}")
    # Python ints: a hostile shape cannot overflow them. Zero dimensions left out: numpy refuses to
    # reshape into (0, 2**62, 2**62) as well.
    if math.prod(d for d in shape if d) * itemsize > 2**63 - 1:
        raise TensorDecodeError(f"tensor {name!r}: the size of shape {shape} overflows int64")
    return math.prod(shape)


def to_indexed_slices(values: np.ndarray, ids: np.ndarray, name: str = "") -> tensor_pb2.IndexedSlices:
    """Encode rows ``values[i]`` of ids ``ids[i]``."""
    return tensor_pb2.IndexedSlices(
        values=to_tensor(values, name), ids=to_tensor(np.asarray(ids, dtype=np.int64), name)
    )


def from_indexed_slices(message: tensor_pb2.IndexedSlices) -> tuple[np.ndarray, np.ndarray]:
    """Decode into ``(values, ids)``; the row counts must agree."""
    values, ids = from_tensor(message.values), from_tensor(message.ids)
    if ids.dtype != np.int64:
        raise TensorDecodeError(
            f"indexed slices {message.values.name[:80]!r}: ids must be int64, got {ids.dtype}"
        )
    if ids.ndim != 1 or values.ndim < 1 or values.shape[0] != ids.shape[0]:
        raise TensorDecodeError(
            f"indexed slices {message.values.name!r}: {ids.shape[0] if ids.ndim else 0} ids "
            f"for values of shape {values.shape}"
        )
    return values, ids
