from edl_argo.proto import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_TYPE_UNSPECIFIED: _ClassVar[TaskType]
    TRAINING: _ClassVar[TaskType]
    EVALUATION: _ClassVar[TaskType]
    PREDICTION: _ClassVar[TaskType]

class StateOrigin(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DESCENDANT: _ClassVar[StateOrigin]
    CHECKPOINT: _ClassVar[StateOrigin]
    MEMBER: _ClassVar[StateOrigin]
    FRESH: _ClassVar[StateOrigin]
TASK_TYPE_UNSPECIFIED: TaskType
TRAINING: TaskType
EVALUATION: TaskType
PREDICTION: TaskType
DESCENDANT: StateOrigin
CHECKPOINT: StateOrigin
MEMBER: StateOrigin
FRESH: StateOrigin

class Task(_message.Message):
    __slots__ = ("task_id", "type", "data_url", "shard", "start", "end", "epoch", "model_version", "shard_version", "data_spec", "read_hint")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_URL_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_SPEC_FIELD_NUMBER: _ClassVar[int]
    READ_HINT_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    type: TaskType
    data_url: str
    shard: str
    start: int
    end: int
    epoch: int
    model_version: int
    shard_version: str
    data_spec: str
    read_hint: str
    def __init__(self, task_id: _Optional[int] = ..., type: _Optional[_Union[TaskType, str]] = ..., data_url: _Optional[str] = ..., shard: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., epoch: _Optional[int] = ..., model_version: _Optional[int] = ..., shard_version: _Optional[str] = ..., data_spec: _Optional[str] = ..., read_hint: _Optional[str] = ...) -> None: ...

class GetTaskRequest(_message.Message):
    __slots__ = ("worker_id", "held_task_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    held_task_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[int] = ..., held_task_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetTaskResponse(_message.Message):
    __slots__ = ("kind", "task")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[GetTaskResponse.Kind]
        TASK: _ClassVar[GetTaskResponse.Kind]
        WAIT: _ClassVar[GetTaskResponse.Kind]
        DONE: _ClassVar[GetTaskResponse.Kind]
    KIND_UNSPECIFIED: GetTaskResponse.Kind
    TASK: GetTaskResponse.Kind
    WAIT: GetTaskResponse.Kind
    DONE: GetTaskResponse.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    kind: GetTaskResponse.Kind
    task: Task
    def __init__(self, kind: _Optional[_Union[GetTaskResponse.Kind, str]] = ..., task: _Optional[_Union[Task, _Mapping]] = ...) -> None: ...

class ReportTaskResultRequest(_message.Message):
    __slots__ = ("worker_id", "task_id", "success", "error_message", "counters", "mean_loss", "fatal", "get_next_task", "model_error")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    FATAL_FIELD_NUMBER: _ClassVar[int]
    GET_NEXT_TASK_FIELD_NUMBER: _ClassVar[int]
    MODEL_ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    task_id: int
    success: bool
    error_message: str
    counters: _containers.ScalarMap[str, int]
    mean_loss: float
    fatal: bool
    get_next_task: bool
    model_error: bool
    def __init__(self, worker_id: _Optional[int] = ..., task_id: _Optional[int] = ..., success: _Optional[bool] = ..., error_message: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ..., mean_loss: _Optional[float] = ..., fatal: _Optional[bool] = ..., get_next_task: _Optional[bool] = ..., model_error: _Optional[bool] = ...) -> None: ...

class ReportTaskResultResponse(_message.Message):
    __slots__ = ("accepted", "next_task")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TASK_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    next_task: GetTaskResponse
    def __init__(self, accepted: _Optional[bool] = ..., next_task: _Optional[_Union[GetTaskResponse, _Mapping]] = ...) -> None: ...

class ReportEvaluationOutputsRequest(_message.Message):
    __slots__ = ("worker_id", "task_id", "model_version", "outputs", "labels", "named_labels")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    NAMED_LABELS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    task_id: int
    model_version: int
    outputs: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    labels: _tensor_pb2.Tensor
    named_labels: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    def __init__(self, worker_id: _Optional[int] = ..., task_id: _Optional[int] = ..., model_version: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ..., labels: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., named_labels: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ...) -> None: ...

class ReportVersionRequest(_message.Message):
    __slots__ = ("worker_id", "model_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    model_version: int
    def __init__(self, worker_id: _Optional[int] = ..., model_version: _Optional[int] = ...) -> None: ...

class ScaleWorkersRequest(_message.Message):
    __slots__ = ("num_workers",)
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    def __init__(self, num_workers: _Optional[int] = ...) -> None: ...

class ScaleWorkersResponse(_message.Message):
    __slots__ = ("num_workers",)
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    def __init__(self, num_workers: _Optional[int] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("worker_id", "address", "state", "formed_round", "formed_from", "formed_state", "checkpoint", "watch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FORMED_ROUND_FIELD_NUMBER: _ClassVar[int]
    FORMED_FROM_FIELD_NUMBER: _ClassVar[int]
    FORMED_STATE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    WATCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    address: str
    state: StatePoint
    formed_round: int
    formed_from: StateOrigin
    formed_state: StatePoint
    checkpoint: StatePoint
    watch: bool
    def __init__(self, worker_id: _Optional[int] = ..., address: _Optional[str] = ..., state: _Optional[_Union[StatePoint, _Mapping]] = ..., formed_round: _Optional[int] = ..., formed_from: _Optional[_Union[StateOrigin, str]] = ..., formed_state: _Optional[_Union[StatePoint, _Mapping]] = ..., checkpoint: _Optional[_Union[StatePoint, _Mapping]] = ..., watch: _Optional[bool] = ...) -> None: ...

class StatePoint(_message.Message):
    __slots__ = ("version", "round_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    round_id: int
    def __init__(self, version: _Optional[int] = ..., round_id: _Optional[int] = ...) -> None: ...

class RendezvousMember(_message.Message):
    __slots__ = ("worker_id", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    address: str
    def __init__(self, worker_id: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class RendezvousResponse(_message.Message):
    __slots__ = ("round_id", "rank", "members", "committed", "checkpoint")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    rank: int
    members: _containers.RepeatedCompositeFieldContainer[RendezvousMember]
    committed: StatePoint
    checkpoint: StatePoint
    def __init__(self, round_id: _Optional[int] = ..., rank: _Optional[int] = ..., members: _Optional[_Iterable[_Union[RendezvousMember, _Mapping]]] = ..., committed: _Optional[_Union[StatePoint, _Mapping]] = ..., checkpoint: _Optional[_Union[StatePoint, _Mapping]] = ...) -> None: ...

class ReportCollectiveFailureRequest(_message.Message):
    __slots__ = ("worker_id", "round_id", "suspect_worker_id", "message")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    round_id: int
    suspect_worker_id: int
    message: str
    def __init__(self, worker_id: _Optional[int] = ..., round_id: _Optional[int] = ..., suspect_worker_id: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
