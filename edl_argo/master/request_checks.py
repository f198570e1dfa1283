"""What the master accepts: the checks of every request's fields, in one place, made before anything changes.

A request that fails one ends with ``INVALID_ARGUMENT`` (a field out of its range) or ``FAILED_PRECONDITION``
(a worker id this job never created), and a one-line message naming the field (values and texts shortened);
the server goes on serving. The upper bounds come from the job (:class:`RequestBounds`): its
``--max-workers``, the workers the master started, and how far the model version can move between two
reports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc

from edl_argo.addresses import AddressError, parse_host_port
from edl_argo.proto import master_pb2
from edl_argo.rpc.auth import pod_identity, require_identity
from edl_argo.rpc.channel import reject_request

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
#: Longest text (an error message a worker reports, a failure it describes) the master keeps or logs.
MAX_TEXT_CHARS = 2000


def _any_worker(_worker_id: int) -> bool:
    return True


@dataclass(frozen=True)
class RequestBounds:
    """The job's limits on requests (the defaults accept any value, for a master without a job around it).

    ``is_worker(id)``: whether the master started a worker with that id that has not stopped.
    ``max_workers``: the most workers ``ScaleWorkers`` may ask for. ``version_tolerance``: how far past the
    newest model version the master knows a reported one may be (the minibatches of the whole job: no
    worker can apply more between two of its reports).
    """

    is_worker: Callable[[int], bool] = _any_worker
    max_workers: int | None = None
    version_tolerance: int | None = None


def shortened(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` cut to ``limit`` characters (saying how much was cut), for logs and the job's failure."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class RequestChecks:
    """The master's checks of request fields against :class:`RequestBounds`; each ends the request being
    served (``context.abort``) when the field is out of bounds."""

    def __init__(self, bounds: RequestBounds, current_version: Callable[[], int]) -> None:
        self._bounds = bounds
        self._current_version = current_version

    def worker_id(self, context: grpc.ServicerContext, rpc: str, worker_id: int) -> None:
        """A worker id the master created, and still runs (FAILED_PRECONDITION otherwise), named by that
        worker itself on an authenticated server (PERMISSION_DENIED otherwise, :mod:`edl_argo.rpc.auth`)."""
        if worker_id < 0:
            reject_request(context, rpc, _INVALID, f"worker_id must be >= 0, got {worker_id}")
        require_identity(context, rpc, pod_identity("worker", worker_id))
        if not self._bounds.is_worker(worker_id):
            reject_request(
                context,
                rpc,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker_id {worker_id} is not a running worker of this job",
            )

    def address(self, context: grpc.ServicerContext, rpc: str, address: str) -> None:
        """``host:port`` with a valid host and a port in 1-65535."""
        try:
            parse_host_port(address)
        except AddressError as error:
            reject_request(context, rpc, _INVALID, str(error))

    def model_version(self, context: grpc.ServicerContext, rpc: str, field: str, version: int) -> None:
        """At least 0, and at most the newest version known plus the tolerance."""
        if version < 0:
            reject_request(context, rpc, _INVALID, f"{field} {version} < 0")
        tolerance = self._bounds.version_tolerance
        if tolerance is not None and version > (limit := self._current_version() + tolerance):
            reject_request(
                context,
                rpc,
                _INVALID,
                f"{field} {version} is beyond any version this job can have reached (at most {limit})",
            )

    def counters(
        self, context: grpc.ServicerContext, rpc: str, task_id: int, counters: Mapping[str, int]
    ) -> None:
        """No counter below 0; a ``model_version`` counter within :meth:`model_version`'s bounds."""
        negative = sorted(name for name, value in counters.items() if value < 0)
        if negative:
            reject_request(
                context, rpc, _INVALID, f"task {task_id}: counter {shortened(negative[0], 80)!r} < 0"
            )
        if "model_version" in counters:
            self.model_version(
                context, rpc, f"task {task_id}: counter 'model_version'", counters["model_version"]
            )

    def num_workers(self, context: grpc.ServicerContext, rpc: str, num_workers: int) -> None:
        """At least 0 and at most ``--max-workers``."""
        if num_workers < 0:
            reject_request(context, rpc, _INVALID, f"num_workers must be >= 0, got {num_workers}")
        limit = self._bounds.max_workers
        if limit is not None and num_workers > limit:
            reject_request(
                context,
                rpc,
                _INVALID,
                f"num_workers {num_workers} is more than this job's --max-workers {limit}",
            )

    def rendezvous_report(
        self, context: grpc.ServicerContext, request: master_pb2.RendezvousRequest, current_round: int
    ) -> None:
        """What a member says it holds names a known way of forming, rounds that exist (at most
        ``current_round``) and versions within :meth:`model_version`'s bounds."""
        rpc = "Rendezvous"
        if request.formed_from not in master_pb2.StateOrigin.values():
            reject_request(context, rpc, _INVALID, f"formed_from {request.formed_from} is no StateOrigin")
        if not 0 <= request.formed_round <= current_round:
            reject_request(
                context,
                rpc,
                _INVALID,
                f"formed_round {request.formed_round} is not a round (0-{current_round})",
            )
        for name in ("state", "formed_state", "checkpoint"):
            point = getattr(request, name)
            if not 0 <= point.round_id <= current_round:
                reject_request(
                    context,
                    rpc,
                    _INVALID,
                    f"{name}.round_id {point.round_id} is not a round (0-{current_round})",
                )
            self.model_version(context, rpc, f"{name}.version", point.version)
