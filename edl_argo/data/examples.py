"""Encode rows as ``tf.train.Example`` records without importing TensorFlow.

The messages come from ``edl_argo/proto/example.proto``, which is wire-compatible with TensorFlow's, so the
bytes written here parse with ``tf.io.parse_example`` in a model's ``feed``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edl_argo.proto import example_pb2

#: What one feature may hold: a scalar or a flat sequence of ints, floats or bytes/str.
FeatureValue = int | float | str | bytes | Sequence[int] | Sequence[float] | Sequence[bytes] | np.ndarray


def encode_example(features: Mapping[str, FeatureValue]) -> bytes:
    """Serialize ``{name: value}`` as a ``tf.train.Example``.

    Integers become ``int64_list``, floats ``float_list``, strings and bytes ``bytes_list``; arrays are
    flattened (the model's ``feed`` gives them their shape back).
    """
    example = example_pb2.Example()
    feature_map = example.features.feature
    for name, value in features.items():
        array = np.asarray(value)
        feature = feature_map[name]
        if array.dtype.kind in "iub":
            feature.int64_list.value.extend(array.astype(np.int64).ravel().tolist())
        elif array.dtype.kind == "f":
            feature.float_list.value.extend(array.astype(np.float32).ravel().tolist())
        elif array.dtype.kind in "SUO":
            feature.bytes_list.value.extend(
                v if isinstance(v, bytes) else str(v).encode() for v in array.ravel().tolist()
            )
        else:
            raise TypeError(f"feature {name!r}: unsupported value type {array.dtype}")
    return example.SerializeToString()


def decode_example(record: bytes) -> dict[str, list[int] | list[float] | list[bytes]]:
    """Parse a serialized ``tf.train.Example`` into ``{name: list of values}`` (for tools and tests)."""
    example = example_pb2.Example.FromString(record)
    decoded: dict[str, list[int] | list[float] | list[bytes]] = {}
    for name, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        decoded[name] = list(getattr(feature, kind).value) if kind else []
    return decoded
