"""The worker's calls to the master, riding out a master restart by retrying with backoff."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edl_argo.model.outputs import SINGLE
from edl_argo.proto import master_pb2, master_pb2_grpc
from edl_argo.rpc.channel import call_with_retry, make_channel
from edl_argo.rpc.tensors import to_tensor


class MasterClient:
    """Get tasks, report results, outputs and versions for one worker id."""

    def __init__(self, address: str, worker_id: int, retry_budget_seconds: float = 300.0) -> None:
        self._address = address
        self._stub = master_pb2_grpc.MasterStub(make_channel(address))
        self.worker_id = worker_id
        self._budget = retry_budget_seconds

    def _call(self, method: str, request: object) -> object:
        rpc = getattr(self._stub, method)
        return call_with_retry(lambda: rpc(request), f"master {self._address}", self._budget)

    def get_task(self) -> master_pb2.GetTaskResponse:
        return self._call("GetTask", master_pb2.GetTaskRequest(worker_id=self.worker_id))

    def report_task_result(
        self,
        task_id: int,
        success: bool,
        error: str = "",
        counters: Mapping[str, int] | None = None,
        mean_loss: float = 0.0,
        fatal: bool = False,
    ) -> master_pb2.ReportTaskResultResponse:
        """Report a task's outcome and ask for the next task (the response's ``next_task``, absent when
        ``fatal``: a failure no retry can cure, which fails the job)."""
        request = master_pb2.ReportTaskResultRequest(
            worker_id=self.worker_id,
            task_id=task_id,
            success=success,
            error_message=error,
            counters=dict(counters or {}),
            mean_loss=mean_loss,
            fatal=fatal,
            get_next_task=not fatal,
        )
        return self._call("ReportTaskResult", request)

    def report_evaluation_outputs(
        self,
        task_id: int,
        model_version: int,
        outputs: Mapping[str, np.ndarray],
        labels: Mapping[str, np.ndarray],
    ) -> None:
        """Send a task's named outputs and labels (:func:`edl_argo.model.outputs.named_arrays`)."""
        request = master_pb2.ReportEvaluationOutputsRequest(
            worker_id=self.worker_id,
            task_id=task_id,
            model_version=model_version,
            outputs=[to_tensor(v, k) for k, v in outputs.items()],
        )
        if list(labels) == [SINGLE]:
            request.labels.CopyFrom(to_tensor(labels[SINGLE], SINGLE))
        else:
            request.named_labels.extend(to_tensor(v, k) for k, v in labels.items())
        self._call("ReportEvaluationOutputs", request)

    def report_version(self, model_version: int) -> None:
        request = master_pb2.ReportVersionRequest(worker_id=self.worker_id, model_version=model_version)
        self._call("ReportVersion", request)

    def rendezvous(
        self, address: str, report: master_pb2.RendezvousRequest | None = None
    ) -> master_pb2.RendezvousResponse:
        """Join the AllreduceStrategy group (first call) and return the current membership round;
        ``report``: the state this member holds (see :mod:`edl_argo.master.rendezvous`)."""
        request = master_pb2.RendezvousRequest()
        if report is not None:
            request.CopyFrom(report)
        request.worker_id, request.address = self.worker_id, address
        return self._call("Rendezvous", request)

    def report_collective_failure(self, round_id: int, suspect_worker_id: int, message: str) -> None:
        request = master_pb2.ReportCollectiveFailureRequest(
            worker_id=self.worker_id,
            round_id=round_id,
            suspect_worker_id=suspect_worker_id,
            message=message,
        )
        self._call("ReportCollectiveFailure", request)
