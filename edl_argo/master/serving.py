"""How the master's gRPC server bounds its clients (:mod:`edl_argo.rpc.server_limits`): the calls the job's
progress depends on have threads of their own, calls in progress are capped, and no call outlives the
callers' deadline by more than the handlers' slack."""

from __future__ import annotations

from edl_argo.master.state_store import master_threads
from edl_argo.rpc.server_limits import ServerLimits

#: The calls the job's progress depends on: served from a pool of their own (:func:`master_server_limits`).
PROGRESS_METHODS = tuple(
    f"/edl_argo.Master/{name}"
    for name in ("GetTask", "ReportTaskResult", "ReportVersion", "Rendezvous", "ReportCollectiveFailure")
)
#: Threads of the master's other calls (evaluation outputs, scaling), and calls in progress at most: the
#: larger of :data:`MAX_CONCURRENT_CALLS` and :data:`CALLS_PER_WORKER` per worker the job may have (a worker
#: asks for its next task while its reporter reports the last, and may report a version meanwhile; a cap
#: below the job's own workers' calls refuses them, RESOURCE_EXHAUSTED, once the job has a few hundred).
OTHER_THREADS = 8
MAX_CONCURRENT_CALLS = 64
CALLS_PER_WORKER = 3
#: A connection is asked to go away after this long (its client opens a new one).
CONNECTION_SECONDS = 60.0
#: The longest a call's handler may legitimately run beyond the caller's deadline (the final GetTask asks the
#: parameter servers to apply their pending updates, retrying for up to a minute).
HANDLER_SLACK_SECONDS = 60.0


def master_server_limits(rpc_timeout_seconds: float, max_workers: int = 0) -> ServerLimits:
    """The master server's bounds (:mod:`edl_argo.rpc.server_limits`): :data:`PROGRESS_METHODS` on
    threads of their own (:func:`~edl_argo.master.state_store.master_threads` of ``max_workers``, the
    most workers the job may have), at most :data:`MAX_CONCURRENT_CALLS` calls at once or
    :data:`CALLS_PER_WORKER` per worker of ``max_workers`` if more, and no call lasting longer than the
    callers' deadline (``--rpc-timeout-seconds``) plus the handlers' slack (a client that sends a call's
    headers and never its body holds a thread that long at most)."""
    return ServerLimits(
        threads=OTHER_THREADS,
        priority_methods=PROGRESS_METHODS,
        priority_threads=master_threads(max_workers),
        max_concurrent_calls=max(MAX_CONCURRENT_CALLS, CALLS_PER_WORKER * max_workers),
        connection_seconds=CONNECTION_SECONDS,
        max_call_seconds=rpc_timeout_seconds + HANDLER_SLACK_SECONDS,
    )
