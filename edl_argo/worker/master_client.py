"""The worker's calls to the master, riding out a master restart by retrying with backoff; every call has a
deadline (``rpc_timeout_seconds``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edl_argo.model.outputs import SINGLE
from edl_argo.proto import master_pb2, master_pb2_grpc
from edl_argo.rpc.channel import RPC_TIMEOUT_SECONDS, call_with_retry, make_channel
from edl_argo.rpc.tensors import to_tensor
from edl_argo.rpc.tls import TlsFiles
from edl_argo.worker.step_timers import STEP_TIMERS


class MasterClient:
    """Get tasks, report results, outputs and versions for one worker id."""

    def __init__(
        self,
        address: str,
        worker_id: int,
        retry_budget_seconds: float = 300.0,
        rpc_timeout_seconds: float = RPC_TIMEOUT_SECONDS,
        tls: TlsFiles | None = None,
    ) -> None:
        """Calls go to the master at ``address``, over TLS with ``tls`` (:mod:`edl_argo.rpc.tls`)."""
        self._address = address
        self._stub = master_pb2_grpc.MasterStub(make_channel(address, tls=tls))
        self.worker_id = worker_id
        self._budget = retry_budget_seconds
        self._timeout = rpc_timeout_seconds

    def _call(self, method: str, request: object, budget_seconds: float | None = None) -> object:
        rpc = getattr(self._stub, method)
        with STEP_TIMERS.section("master"):
            return call_with_retry(
                lambda timeout: rpc(request, timeout=timeout),
                f"master {self._address}",
                self._budget if budget_seconds is None else budget_seconds,
                self._timeout,
            )

    def get_task(self, held_task_ids: Sequence[int] = ()) -> master_pb2.GetTaskResponse:
        """The next task, beyond ``held_task_ids`` (tasks this worker holds and knows it holds)."""
        request = master_pb2.GetTaskRequest(worker_id=self.worker_id, held_task_ids=list(held_task_ids))
        return self._call("GetTask", request)

    def report_task_result(
        self,
        task_id: int,
        success: bool,
        error: str = "",
        counters: Mapping[str, int] | None = None,
        mean_loss: float = 0.0,
        fatal: bool = False,
        next_task: bool = True,
        model_error: bool = False,
    ) -> master_pb2.ReportTaskResultResponse:
        """Report a task's outcome and, with ``next_task``, ask for the next task (the response's
        ``next_task``, absent when ``fatal``: a failure no retry can cure, which fails the job).
        ``model_error``: ``error`` was raised in the model file's code (:mod:`edl_argo.model.user_code`)."""
        request = master_pb2.ReportTaskResultRequest(
            worker_id=self.worker_id,
            task_id=task_id,
            success=success,
            error_message=error,
            counters=dict(counters or {}),
            mean_loss=mean_loss,
            fatal=fatal,
            get_next_task=next_task and not fatal,
            model_error=model_error,
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
        self,
        address: str,
        report: master_pb2.RendezvousRequest | None = None,
        budget_seconds: float | None = None,
    ) -> master_pb2.RendezvousResponse:
        """Join the AllreduceStrategy group (first call) and return the current membership round;
        ``report``: the state this member holds (see :mod:`edl_argo.master.rendezvous`); within
        ``budget_seconds`` when given (else the client's retry budget)."""
        request = master_pb2.RendezvousRequest()
        if report is not None:
            request.CopyFrom(report)
        request.worker_id, request.address = self.worker_id, address
        return self._call("Rendezvous", request, budget_seconds)

    def report_collective_failure(self, round_id: int, suspect_worker_id: int, message: str) -> None:
        request = master_pb2.ReportCollectiveFailureRequest(
            worker_id=self.worker_id,
            round_id=round_id,
            suspect_worker_id=suspect_worker_id,
            message=message,
        )
        self._call("ReportCollectiveFailure", request)
