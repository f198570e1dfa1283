from edl_argo.proto import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CollectiveChunk(_message.Message):
    __slots__ = ("round_id", "operation", "step", "sender_rank", "data")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SENDER_RANK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    operation: int
    step: int
    sender_rank: int
    data: _tensor_pb2.Tensor
    def __init__(self, round_id: _Optional[int] = ..., operation: _Optional[int] = ..., step: _Optional[int] = ..., sender_rank: _Optional[int] = ..., data: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ("round_id",)
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    def __init__(self, round_id: _Optional[int] = ...) -> None: ...

class ModelState(_message.Message):
    __slots__ = ("round_id", "version", "variables", "recent_step_rounds")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    RECENT_STEP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    version: int
    variables: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    recent_step_rounds: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round_id: _Optional[int] = ..., version: _Optional[int] = ..., variables: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., recent_step_rounds: _Optional[_Iterable[int]] = ...) -> None: ...
