from edl_argo.proto import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Chunk(_message.Message):
    __slots__ = ("data", "last")
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    last: bool
    def __init__(self, data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class EmbeddingTableInfo(_message.Message):
    __slots__ = ("name", "dim", "initializer", "dtype", "constraint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    initializer: str
    dtype: str
    constraint: str
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., initializer: _Optional[str] = ..., dtype: _Optional[str] = ..., constraint: _Optional[str] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("version", "dense_parameters", "embedding_table_infos", "embedding_tables", "non_trainable_parameters", "constraints", "dense_layout", "packed_dense_parameters", "packed_non_trainable_parameters")
    class EmbeddingTablesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.IndexedSlices
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.IndexedSlices, _Mapping]] = ...) -> None: ...
    class ConstraintsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class DenseLayoutEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DENSE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_TABLE_INFOS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_TABLES_FIELD_NUMBER: _ClassVar[int]
    NON_TRAINABLE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINTS_FIELD_NUMBER: _ClassVar[int]
    DENSE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PACKED_DENSE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PACKED_NON_TRAINABLE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    dense_parameters: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    embedding_table_infos: _containers.RepeatedCompositeFieldContainer[EmbeddingTableInfo]
    embedding_tables: _containers.MessageMap[str, _tensor_pb2.IndexedSlices]
    non_trainable_parameters: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    constraints: _containers.ScalarMap[str, str]
    dense_layout: _containers.ScalarMap[str, int]
    packed_dense_parameters: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.PackedTensors]
    packed_non_trainable_parameters: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.PackedTensors]
    def __init__(self, version: _Optional[int] = ..., dense_parameters: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., embedding_table_infos: _Optional[_Iterable[_Union[EmbeddingTableInfo, _Mapping]]] = ..., embedding_tables: _Optional[_Mapping[str, _tensor_pb2.IndexedSlices]] = ..., non_trainable_parameters: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., constraints: _Optional[_Mapping[str, str]] = ..., dense_layout: _Optional[_Mapping[str, int]] = ..., packed_dense_parameters: _Optional[_Iterable[_Union[_tensor_pb2.PackedTensors, _Mapping]]] = ..., packed_non_trainable_parameters: _Optional[_Iterable[_Union[_tensor_pb2.PackedTensors, _Mapping]]] = ...) -> None: ...

class PushModelResponse(_message.Message):
    __slots__ = ("accepted", "version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: int
    def __init__(self, accepted: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class PullDenseParametersRequest(_message.Message):
    __slots__ = ("version", "finalized")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINALIZED_FIELD_NUMBER: _ClassVar[int]
    version: int
    finalized: bool
    def __init__(self, version: _Optional[int] = ..., finalized: _Optional[bool] = ...) -> None: ...

class PullDenseParametersResponse(_message.Message):
    __slots__ = ("initialized", "version", "dense_parameters", "synced_step", "synchronous", "packed_parameters")
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DENSE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    SYNCED_STEP_FIELD_NUMBER: _ClassVar[int]
    SYNCHRONOUS_FIELD_NUMBER: _ClassVar[int]
    PACKED_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    initialized: bool
    version: int
    dense_parameters: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    synced_step: int
    synchronous: bool
    packed_parameters: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.PackedTensors]
    def __init__(self, initialized: _Optional[bool] = ..., version: _Optional[int] = ..., dense_parameters: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., synced_step: _Optional[int] = ..., synchronous: _Optional[bool] = ..., packed_parameters: _Optional[_Iterable[_Union[_tensor_pb2.PackedTensors, _Mapping]]] = ...) -> None: ...

class PullEmbeddingVectorsRequest(_message.Message):
    __slots__ = ("name", "ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: _tensor_pb2.Tensor
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PullEmbeddingVectorsBatchRequest(_message.Message):
    __slots__ = ("lookups",)
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    lookups: _containers.RepeatedCompositeFieldContainer[PullEmbeddingVectorsRequest]
    def __init__(self, lookups: _Optional[_Iterable[_Union[PullEmbeddingVectorsRequest, _Mapping]]] = ...) -> None: ...

class PullEmbeddingVectorsBatchResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    def __init__(self, rows: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ...) -> None: ...

class PullEmbeddingTableRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class PushGradientsRequest(_message.Message):
    __slots__ = ("gradients", "version", "learning_rate_scale", "authority_step", "examples", "return_parameters", "pusher_id", "sequence")
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_SCALE_FIELD_NUMBER: _ClassVar[int]
    AUTHORITY_STEP_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    RETURN_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PUSHER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    gradients: Model
    version: int
    learning_rate_scale: float
    authority_step: int
    examples: int
    return_parameters: bool
    pusher_id: str
    sequence: int
    def __init__(self, gradients: _Optional[_Union[Model, _Mapping]] = ..., version: _Optional[int] = ..., learning_rate_scale: _Optional[float] = ..., authority_step: _Optional[int] = ..., examples: _Optional[int] = ..., return_parameters: _Optional[bool] = ..., pusher_id: _Optional[str] = ..., sequence: _Optional[int] = ...) -> None: ...

class PushGradientsResponse(_message.Message):
    __slots__ = ("accepted", "version", "step", "parameters")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: int
    step: int
    parameters: PullDenseParametersResponse
    def __init__(self, accepted: _Optional[bool] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., parameters: _Optional[_Union[PullDenseParametersResponse, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("apply_pending",)
    APPLY_PENDING_FIELD_NUMBER: _ClassVar[int]
    apply_pending: bool
    def __init__(self, apply_pending: _Optional[bool] = ...) -> None: ...

class ParameterServerStatus(_message.Message):
    __slots__ = ("initialized", "version", "pushes_accepted", "pushes_refused", "pending_applied", "pending", "restored_version", "pushes_non_finite", "pushes_repeated", "tensor_port", "gradient_bytes_accepted")
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PUSHES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    PENDING_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    RESTORED_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUSHES_NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REPEATED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PORT_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_BYTES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    initialized: bool
    version: int
    pushes_accepted: int
    pushes_refused: int
    pending_applied: int
    pending: int
    restored_version: int
    pushes_non_finite: int
    pushes_repeated: int
    tensor_port: str
    gradient_bytes_accepted: int
    def __init__(self, initialized: _Optional[bool] = ..., version: _Optional[int] = ..., pushes_accepted: _Optional[int] = ..., pushes_refused: _Optional[int] = ..., pending_applied: _Optional[int] = ..., pending: _Optional[int] = ..., restored_version: _Optional[int] = ..., pushes_non_finite: _Optional[int] = ..., pushes_repeated: _Optional[int] = ..., tensor_port: _Optional[str] = ..., gradient_bytes_accepted: _Optional[int] = ...) -> None: ...
