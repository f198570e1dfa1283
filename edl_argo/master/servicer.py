"""The master's gRPC service: a thin translation between the wire and the dispatcher/evaluation.

Every request is checked before anything changes (:mod:`edl_argo.master.request_checks`): a malformed one
(a negative worker id, version or counter, a version beyond the job's reach, a worker id the master never
started, an address that is not ``host:port``, an undecodable tensor, outputs without one row per label, or
that the model's metrics refuse) ends with ``INVALID_ARGUMENT`` or ``FAILED_PRECONDITION`` and a one-line
reason naming the field, and the server goes on serving. A failure of the master's own code while serving
evaluation outputs is ``INTERNAL`` (logged as ``request_failed`` with its traceback, on one line), never
blamed on the caller. Reports about a task the worker does not hold (unknown, done, reclaimed) are
ignored, as :meth:`TaskDispatcher.report` ignores them, and an ignored report changes nothing: no model
version, evaluation round or counter (but the ledger's count of what reached the PS:
:meth:`~edl_argo.master.ledger.TrainingLedger.add_ignored`). A failed task reported as ``fatal`` (the loss
became NaN) fails the job at once, with the worker's message (shortened to
:data:`~edl_argo.master.request_checks.MAX_TEXT_CHARS`).
A ``GetTask`` lists the tasks the worker holds: one the master has it holding but it does not list is one
whose reply it never got, and is handed to it again (:func:`~edl_argo.master.failover.lost_reply`); one it
lists that the master never handed out keeps its id from other tasks
(:func:`~edl_argo.master.failover.skip_unsaved_task_ids`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import grpc

from edl_argo.log import get_logger
from edl_argo.master.evaluation import EvaluationService, MetricsRefusedError
from edl_argo.master.failover import lost_reply, skip_unsaved_task_ids
from edl_argo.master.ledger import TrainingLedger
from edl_argo.master.rendezvous import RendezvousManager
from edl_argo.master.request_checks import RequestBounds, RequestChecks, shortened
from edl_argo.master.task_dispatcher import Task, TaskAssignment, TaskDispatcher, TaskType
from edl_argo.master.training_stats import TrainingLoss, TrainingReport
from edl_argo.model.outputs import SINGLE
from edl_argo.proto import master_pb2, master_pb2_grpc, tensor_pb2
from edl_argo.readers import OpenedDataset, worker_spec_json
from edl_argo.rpc.auth import OPERATOR_IDENTITIES, require_identity
from edl_argo.rpc.channel import reject_request
from edl_argo.rpc.tensors import TensorDecodeError, from_tensor

log = get_logger(__name__)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT

_TASK_TYPES = {
    TaskType.TRAINING: master_pb2.TRAINING,
    TaskType.EVALUATION: master_pb2.EVALUATION,
    TaskType.PREDICTION: master_pb2.PREDICTION,
}


class MasterServicer(master_pb2_grpc.MasterServicer):
    """Serves workers. ``data_urls`` maps a task type to the dataset root its shards belong to, and
    ``datasets`` (optional) a task type to the dataset the master opened for it: every task then carries
    the dataset's reader spec, the version of its shard pinned when the dataset was opened (workers read
    only that version) and where its records lie (:meth:`~edl_argo.readers.OpenedDataset.locate`).

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
        rendezvous: RendezvousManager | None = None,
        ready_to_finish: Callable[[], bool] = lambda: True,
        datasets: Mapping[TaskType, OpenedDataset] | None = None,
        finish_training: Callable[[], None] = lambda: None,
        ledger: TrainingLedger | None = None,
        bounds: RequestBounds | None = None,
        on_training_report: Callable[[TrainingReport], None] | None = None,
    ) -> None:
        """``finish_training`` runs when every training task is done, before the final evaluation round
        is queued (the PSes apply the pushes a synchronous step still waits for); it may run more than
        once and must be idempotent. ``ledger`` checks and counts what workers report they trained: a
        training task whose report does not add up fails the job. ``bounds``: the job's limits on what a
        request may carry (default: none beyond the fields' own ranges). ``on_training_report`` gets every
        successful training task report the dispatcher accepted, once (a repeated report is not accepted),
        on the serving thread: it must not block."""
        self._on_training_report = on_training_report
        self._checks = RequestChecks(bounds or RequestBounds(), current_version)
        self._datasets = dict(datasets or {})
        self._data_specs = {kind: worker_spec_json(data) for kind, data in self._datasets.items()}
        self._finish_training = finish_training
        self._ledger = ledger
        self._training_loss = training_loss or TrainingLoss()
        self._rendezvous = rendezvous
        self._ready_to_finish = ready_to_finish
        self._dispatcher = dispatcher
        self._evaluation = evaluation
        self._data_urls = data_urls
        self._current_version = current_version
        self._on_version = on_version
        self._scale_workers = scale_workers

    def GetTask(
        self, request: master_pb2.GetTaskRequest, context: grpc.ServicerContext
    ) -> master_pb2.GetTaskResponse:
        self._checks.worker_id(context, "GetTask", request.worker_id)
        skip_unsaved_task_ids(self._dispatcher, request.worker_id, request.held_task_ids)
        lost = lost_reply(self._dispatcher, request.worker_id, request.held_task_ids)
        assignment = (
            TaskAssignment("task", lost) if lost is not None else self._dispatcher.get_task(request.worker_id)
        )
        if assignment.kind == "done" and self._dispatcher.failure is None:
            self._finish_training()
            if self._evaluation.start_final_round(self._current_version()):
                assignment = self._dispatcher.get_task(request.worker_id)
            elif not self._evaluation.final_done or not self._ready_to_finish():
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
        data = self._datasets.get(task.type)
        return master_pb2.Task(
            task_id=task.task_id,
            type=_TASK_TYPES[task.type],
            data_url=self._data_urls[task.type],
            data_spec=self._data_specs.get(task.type, ""),
            read_hint=data.locate(task.shard, task.start, task.end) if data is not None else "",
            shard=task.shard,
            shard_version=data.versions.get(task.shard, "") if data is not None else "",
            start=task.start,
            end=task.end,
            epoch=task.epoch,
            model_version=task.model_version,
        )

    def ReportTaskResult(
        self, request: master_pb2.ReportTaskResultRequest, context: grpc.ServicerContext
    ) -> master_pb2.ReportTaskResultResponse:
        self._checks.worker_id(context, "ReportTaskResult", request.worker_id)
        self._checks.counters(context, "ReportTaskResult", request.task_id, request.counters)
        if not math.isfinite(request.mean_loss):
            reject_request(
                context, "ReportTaskResult", _INVALID, f"task {request.task_id}: mean_loss is not finite"
            )
        error_message = shortened(request.error_message)
        if request.fatal and not request.success:
            accepted = self._dispatcher.fail_task(request.task_id, request.worker_id, error_message)
            return master_pb2.ReportTaskResultResponse(accepted=accepted)  # the job failed: no next task
        task = self._dispatcher.held_task(request.task_id, request.worker_id)
        ledger = self._ledger if task is not None and task.type is TaskType.TRAINING else None
        if ledger is not None and task is not None and request.success:
            problem = ledger.check(task, request.counters)
            if problem is not None:
                accepted = self._dispatcher.fail_task(request.task_id, request.worker_id, problem)
                return master_pb2.ReportTaskResultResponse(accepted=accepted)  # the job failed
            ledger.add(task, request.counters, request.worker_id)  # first: a state saved in between counts it
        accepted = self._dispatcher.report(
            request.task_id,
            request.worker_id,
            request.success,
            error_message,
            model_error=request.model_error,
        )
        if ledger is not None and task is not None:
            if request.success and not accepted:
                ledger.remove(task)
            elif not request.success and accepted:
                ledger.add_failed_attempt(request.counters)
        if request.success and not accepted and self._ledger is not None:
            self._ledger.add_ignored(request.task_id, request.worker_id, request.counters)  # it was trained
        if accepted and request.success and task is not None and task.type is TaskType.TRAINING:
            if "steps" in request.counters:
                self._training_loss.add(task.epoch, request.mean_loss, request.counters["steps"])
            if self._on_training_report is not None:
                self._on_training_report(
                    TrainingReport(
                        request.worker_id,
                        task.epoch,
                        task.num_records,
                        request.counters.get("steps", 0),
                        request.mean_loss,
                        request.counters.get("model_version", self._current_version()),
                    )
                )
            self._training_loss.add_skipped(request.counters)
            self._training_loss.skip_nan_gradients(
                request.worker_id, request.counters.get("nan_gradients_skipped", 0)
            )
        if accepted and "model_version" in request.counters and self._on_version is not None:
            self._on_version(request.counters["model_version"])
        response = master_pb2.ReportTaskResultResponse(accepted=accepted)
        if request.get_next_task:
            next_request = master_pb2.GetTaskRequest(worker_id=request.worker_id)
            response.next_task.CopyFrom(self.GetTask(next_request, context))
        return response

    def ReportEvaluationOutputs(
        self, request: master_pb2.ReportEvaluationOutputsRequest, context: grpc.ServicerContext
    ) -> tensor_pb2.Empty:
        rpc = "ReportEvaluationOutputs"
        self._checks.worker_id(context, rpc, request.worker_id)
        try:
            outputs = {t.name or SINGLE: from_tensor(t) for t in request.outputs}
            label_tensors = list(request.named_labels)
            labels = {t.name: from_tensor(t) for t in label_tensors}
            if not label_tensors:  # one labels tensor
                label_tensors = [request.labels]
                labels = {SINGLE: from_tensor(request.labels)}
        except TensorDecodeError as error:
            reject_request(context, rpc, _INVALID, str(error))
        arrays = [*outputs.values(), *labels.values()]
        if (
            not outputs
            or len(outputs) != len(request.outputs)
            or len(labels) != len(label_tensors)
            or any(a.ndim == 0 or len(a) != len(arrays[0]) for a in arrays)
        ):
            reject_request(
                context, rpc, _INVALID, "uniquely named outputs and labels with one row per label expected"
            )
        task = self._dispatcher.held_task(request.task_id, request.worker_id)
        if (
            task is None
            or task.type is not TaskType.EVALUATION
            or task.model_version != request.model_version
        ):
            log.warning("outputs_ignored", task=request.task_id, worker=request.worker_id, reason="not_held")
            return tensor_pb2.Empty()
        try:
            self._evaluation.report_outputs(request.task_id, request.model_version, outputs, labels)
        except MetricsRefusedError as error:  # the model's metrics refuse them (wrong width, dtype, ...)
            reason = f"{task.describe()}: the metrics refuse its outputs: {error}"
            reject_request(context, rpc, _INVALID, reason.splitlines()[0][:500])
        except Exception as error:  # a bug of the master's: not the caller's fault
            log.error(
                "request_failed", exc_info=True, rpc=rpc, task=request.task_id, worker=request.worker_id
            )
            context.abort(
                grpc.StatusCode.INTERNAL, f"{rpc}: the master failed ({type(error).__name__}); see its log"
            )
        return tensor_pb2.Empty()

    def ReportVersion(
        self, request: master_pb2.ReportVersionRequest, context: grpc.ServicerContext
    ) -> tensor_pb2.Empty:
        self._checks.worker_id(context, "ReportVersion", request.worker_id)
        self._checks.model_version(context, "ReportVersion", "model_version", request.model_version)
        held = self._dispatcher.oldest_held_task(request.worker_id)
        if held is None or held.type is not TaskType.TRAINING:
            # Workers report versions while they train a task: this one's is reclaimed, or it is no worker.
            log.warning("version_ignored", worker=request.worker_id, reason="no_training_task")
        elif self._on_version is not None:
            self._on_version(request.model_version)
        return tensor_pb2.Empty()

    def ScaleWorkers(
        self, request: master_pb2.ScaleWorkersRequest, context: grpc.ServicerContext
    ) -> master_pb2.ScaleWorkersResponse:
        if self._scale_workers is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this master cannot scale its workers")
        require_identity(context, "ScaleWorkers", *OPERATOR_IDENTITIES)
        self._checks.num_workers(context, "ScaleWorkers", request.num_workers)
        return master_pb2.ScaleWorkersResponse(num_workers=self._scale_workers(request.num_workers))

    def _require_rendezvous(self, context: grpc.ServicerContext) -> RendezvousManager:
        if self._rendezvous is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this job does not use AllreduceStrategy: there is no worker group to join",
            )
        return self._rendezvous

    def Rendezvous(
        self, request: master_pb2.RendezvousRequest, context: grpc.ServicerContext
    ) -> master_pb2.RendezvousResponse:
        rendezvous = self._require_rendezvous(context)
        self._checks.worker_id(context, "Rendezvous", request.worker_id)
        self._checks.address(context, "Rendezvous", request.address)
        self._checks.rendezvous_report(context, request, rendezvous.current.round_id)
        current = rendezvous.rendezvous(request.worker_id, request.address, request)
        return rendezvous.response(current, request.worker_id)

    def ReportCollectiveFailure(
        self, request: master_pb2.ReportCollectiveFailureRequest, context: grpc.ServicerContext
    ) -> tensor_pb2.Empty:
        rendezvous = self._require_rendezvous(context)
        self._checks.worker_id(context, "ReportCollectiveFailure", request.worker_id)
        rendezvous.report_failure(
            request.worker_id, request.round_id, request.suspect_worker_id, shortened(request.message, 300)
        )
        return tensor_pb2.Empty()
