"""The master's gRPC service: a thin translation between the wire and the dispatcher/evaluation."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from edl_argo.log import get_logger
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.task_dispatcher import Task, TaskDispatcher, TaskType
from edl_argo.master.training_stats import TrainingLoss
from edl_argo.proto import master_pb2, master_pb2_grpc, tensor_pb2
from edl_argo.rpc.tensors import TensorDecodeError, from_tensor

log = get_logger(__name__)

_TASK_TYPES = {
    TaskType.TRAINING: master_pb2.TRAINING,
    TaskType.EVALUATION: master_pb2.EVALUATION,
    TaskType.PREDICTION: master_pb2.PREDICTION,
}


class MasterServicer(master_pb2_grpc.MasterServicer):
    """Serves workers. ``data_urls`` maps a task type to the dataset root its shards belong to.

    When the dispatcher has nothing left, the final evaluation round is queued before any worker is
    told DONE, so the final model is always evaluated.
    """

    def __init__(
        self,
        dispatcher: TaskDispatcher,
        evaluation: EvaluationService,
        data_urls: dict[TaskType, str],
        current_version: Callable[[], int],
        on_version: Callable[[int], None] | None = None,
        scale_workers: Callable[[int], int] | None = None,
        training_loss: TrainingLoss | None = None,
    ) -> None:
        self._training_loss = training_loss or TrainingLoss()
        self._dispatcher = dispatcher
        self._evaluation = evaluation
        self._data_urls = data_urls
        self._current_version = current_version
        self._on_version = on_version
        self._scale_workers = scale_workers

    def GetTask(
        self, request: master_pb2.GetTaskRequest, context: grpc.ServicerContext
    ) -> master_pb2.GetTaskResponse:
        assignment = self._dispatcher.get_task(request.worker_id)
        if assignment.kind == "done" and self._dispatcher.failure is None:
            if self._evaluation.start_final_round(self._current_version()):
                assignment = self._dispatcher.get_task(request.worker_id)
            elif not self._evaluation.final_done:
                return master_pb2.GetTaskResponse(kind=master_pb2.GetTaskResponse.WAIT)
        if assignment.kind == "task" and assignment.task is not None:
            return master_pb2.GetTaskResponse(
                kind=master_pb2.GetTaskResponse.TASK, task=self._to_proto(assignment.task)
            )
        kind = (
            master_pb2.GetTaskResponse.DONE if assignment.kind == "done" else master_pb2.GetTaskResponse.WAIT
        )
        return master_pb2.GetTaskResponse(kind=kind)

    def _to_proto(self, task: Task) -> master_pb2.Task:
        return master_pb2.Task(
            task_id=task.task_id,
            type=_TASK_TYPES[task.type],
            data_url=self._data_urls[task.type],
            shard=task.shard,
            start=task.start,
            end=task.end,
            epoch=task.epoch,
            model_version=task.model_version,
        )

    def ReportTaskResult(
        self, request: master_pb2.ReportTaskResultRequest, context: grpc.ServicerContext
    ) -> master_pb2.ReportTaskResultResponse:
        accepted = self._dispatcher.report(
            request.task_id, request.worker_id, request.success, request.error_message
        )
        if accepted and request.success and "steps" in request.counters:
            self._training_loss.add(
                request.counters.get("epoch", 0), request.mean_loss, request.counters["steps"]
            )
        if "model_version" in request.counters and self._on_version is not None:
            self._on_version(request.counters["model_version"])
        return master_pb2.ReportTaskResultResponse(accepted=accepted)

    def ReportEvaluationOutputs(
        self, request: master_pb2.ReportEvaluationOutputsRequest, context: grpc.ServicerContext
    ) -> tensor_pb2.Empty:
        try:
            outputs = [from_tensor(t) for t in request.outputs]
            labels = from_tensor(request.labels)
        except TensorDecodeError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if len(outputs) != 1 or len(outputs[0]) != len(labels):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "one output tensor with one row per label expected"
            )
        self._evaluation.report_outputs(request.task_id, request.model_version, outputs[0], labels)
        return tensor_pb2.Empty()

    def ReportVersion(
        self, request: master_pb2.ReportVersionRequest, context: grpc.ServicerContext
    ) -> tensor_pb2.Empty:
        if self._on_version is not None:
            self._on_version(request.model_version)
        return tensor_pb2.Empty()

    def ScaleWorkers(
        self, request: master_pb2.ScaleWorkersRequest, context: grpc.ServicerContext
    ) -> master_pb2.ScaleWorkersResponse:
        if self._scale_workers is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this master cannot scale its workers")
        if request.num_workers < 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"num_workers must be >= 0, got {request.num_workers}"
            )
        return master_pb2.ScaleWorkersResponse(num_workers=self._scale_workers(request.num_workers))
