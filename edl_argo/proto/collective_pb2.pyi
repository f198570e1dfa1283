from edl_argo.proto import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelState(_message.Message):
    __slots__ = ("round_id", "version", "variables", "recent_step_rounds", "lineage_rounds", "lineage_versions")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    RECENT_STEP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    version: int
    variables: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    recent_step_rounds: _containers.RepeatedScalarFieldContainer[int]
    lineage_rounds: _containers.RepeatedScalarFieldContainer[int]
    lineage_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round_id: _Optional[int] = ..., version: _Optional[int] = ..., variables: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., recent_step_rounds: _Optional[_Iterable[int]] = ..., lineage_rounds: _Optional[_Iterable[int]] = ..., lineage_versions: _Optional[_Iterable[int]] = ...) -> None: ...
