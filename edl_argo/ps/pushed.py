"""A push as the parameter server reads it: its scalar fields, and its tensors as arrays.

A push's gradients are most of its bytes. Parsed as a protobuf message, each tensor's bytes would be
copied twice more (into the message, then out of it into an array); :meth:`PushedGradients.parse` instead
reads the ``Tensor`` and ``PackedTensors`` fields (:mod:`edl_argo.rpc.packed`) from the chunks the push
came in (:mod:`edl_argo.rpc.rope`), each copied once into an aligned array that TensorFlow takes without a
copy, and leaves only the small fields to protobuf.
A push that arrives as a message (the unary ``PushGradients``) is read the same way
(:meth:`PushedGradients.of_message`), so the servicer has one path for both transports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from edl_argo.proto import ps_pb2, tensor_pb2
from edl_argo.rpc import ps_layout
from edl_argo.rpc.packed import NamedArrays, read_all, read_packed_ropes
from edl_argo.rpc.rope import Rope, merged, read_tensor_rope, split_rope, split_rope_fields
from edl_argo.rpc.wire import read_tensor, split_field

_DENSE = ps_layout.MODEL_FIELDS["dense_parameters"]
_NON_TRAINABLE = ps_layout.MODEL_FIELDS["non_trainable_parameters"]
_PACKED_DENSE = ps_layout.MODEL_FIELDS["packed_dense_parameters"]
_PACKED_NON_TRAINABLE = ps_layout.MODEL_FIELDS["packed_non_trainable_parameters"]


@dataclass(frozen=True)
class PushedModel:
    """The ``Model`` of a push: dense gradients and changes of non-trainable variables as read-only arrays,
    the embedding tables' row gradients as their messages (their rows are few)."""

    dense: NamedArrays
    non_trainable: NamedArrays
    embedding_tables: Mapping[str, tensor_pb2.IndexedSlices]

    @classmethod
    def parse(cls, data: Rope) -> PushedModel:
        """Read a serialized ``Model`` (``WireError``, ``TensorDecodeError`` or protobuf's ``DecodeError``
        for bytes that are not one): the dense gradients, and each group of small tensors packed by dtype,
        copied once from the chunks into arrays of their own (:func:`~edl_argo.rpc.rope.read_tensor_rope`,
        :func:`~edl_argo.rpc.packed.read_packed_ropes`), the rest (a few small tensors) viewed."""
        rest, large = split_rope_fields(data, (_DENSE, _PACKED_DENSE, _PACKED_NON_TRAINABLE))
        rest, non_trainable = split_field(rest, _NON_TRAINABLE)
        small = ps_pb2.Model.FromString(rest)
        return cls(
            [*read_packed_ropes(large[_PACKED_DENSE]), *(read_tensor_rope(t) for t in large[_DENSE])],
            [*read_packed_ropes(large[_PACKED_NON_TRAINABLE]), *(read_tensor(t) for t in non_trainable)],
            small.embedding_tables,
        )

    @classmethod
    def of_message(cls, model: ps_pb2.Model) -> PushedModel:
        return cls(
            read_all(model.dense_parameters, model.packed_dense_parameters),
            read_all(model.non_trainable_parameters, model.packed_non_trainable_parameters),
            model.embedding_tables,
        )


@dataclass(frozen=True)
class PushedGradients:
    """A ``PushGradientsRequest``: ``fields`` holds every field but ``gradients``."""

    fields: ps_pb2.PushGradientsRequest
    gradients: PushedModel

    @classmethod
    def parse(cls, data: Rope) -> PushedGradients:
        """Read a serialized ``PushGradientsRequest`` (errors as :meth:`PushedModel.parse`)."""
        rest, models = split_rope(data, ps_layout.PUSH_GRADIENTS)
        return cls(ps_pb2.PushGradientsRequest.FromString(rest), PushedModel.parse(merged(models)))

    @classmethod
    def of_message(cls, request: ps_pb2.PushGradientsRequest) -> PushedGradients:
        fields = ps_pb2.PushGradientsRequest()
        fields.CopyFrom(request)
        fields.ClearField("gradients")
        return cls(fields, PushedModel.of_message(request.gradients))
