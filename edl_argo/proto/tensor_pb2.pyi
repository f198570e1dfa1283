from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "content")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    content: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., content: _Optional[bytes] = ...) -> None: ...

class PackedTensors(_message.Message):
    __slots__ = ("data", "members")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    data: Tensor
    members: _containers.RepeatedCompositeFieldContainer[PackedMember]
    def __init__(self, data: _Optional[_Union[Tensor, _Mapping]] = ..., members: _Optional[_Iterable[_Union[PackedMember, _Mapping]]] = ...) -> None: ...

class PackedMember(_message.Message):
    __slots__ = ("name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class IndexedSlices(_message.Message):
    __slots__ = ("values", "ids")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    values: Tensor
    ids: Tensor
    def __init__(self, values: _Optional[_Union[Tensor, _Mapping]] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
