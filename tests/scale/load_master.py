"""The master of a load run, in a process of its own: ``python -m tests.scale.load_master --state URL ...``
prints ``PORT <master> <control>`` and serves until killed.

It is the real master's service as ``edl-argo train`` builds it (:mod:`edl_argo.master.job`), without pods
or a model: a :class:`TaskDispatcher` over ``--shards`` shards of ``--shard-records`` records each, cut into
tasks of ``--records-per-task``; the :class:`DurableMasterServicer` with its :class:`GroupCommit` and
:class:`MasterStateStore` on ``--state`` (a folder or ``s3://``); the ledger, the training loss, an
evaluation service without validation data; the job-secret interceptor and the server limits of a real
master (:func:`master_server_limits`). Pods are a :class:`PodManager` over :class:`SimulatedPods`, a backend
that starts nothing: the workers are the load generator's. A worker that vanishes is reported to the master
as the Kubernetes backend would report it, a FAILED pod event that the master's loop hands to
:meth:`PodManager.handle` (tasks requeued, ``worker_died``; a replacement started with a new id).

A second, unauthenticated server on loopback (``control`` port) is the load generator's only other way in:
``WorkerLost`` (JSON ``{"worker_id": n}`` → ``{"replacement": m}``) and ``Stats`` (JSON ``{"since": t}`` →
the saves completed since ``t``: when, snapshot and write seconds, bytes; the dispatcher's accounting; the
ledger's records per epoch). The job secret comes from ``EDL_JOB_SECRET``, as a PS pod gets it.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from edl_argo import log
from edl_argo.master.config import TrainConfig
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.failover import MasterParts, state_to_save
from edl_argo.master.job import VersionTracker
from edl_argo.master.ledger import TrainingLedger
from edl_argo.master.pod_manager import PodManager, PodPolicy
from edl_argo.master.request_checks import RequestBounds
from edl_argo.master.serving import master_server_limits
from edl_argo.master.state_store import (
    DurableMasterServicer,
    GroupCommit,
    MasterStateStore,
    job_fingerprint,
    save_waiters,
)
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType
from edl_argo.master.training_stats import TrainingLoss
from edl_argo.pods import PodBackend, PodEvent, PodPhase, PodReason, PodRole, PodSpec, PodStatus
from edl_argo.proto import master_pb2_grpc
from edl_argo.rpc.auth import SECRET_ENV, secret_from_env, server_interceptor
from edl_argo.rpc.channel import make_server
from edl_argo.storage import Storage, open_storage

JOB_NAME = "scale-load"
MINIBATCH_SIZE = 64
RPC_TIMEOUT_SECONDS = 30.0
#: How often the master's loop takes pod events and reclaims timed-out tasks (the real loop's pace).
LOOP_SECONDS = 0.2
#: The longest ``WorkerLost`` waits for the replacement the pod manager starts.
REPLACEMENT_WAIT_SECONDS = 10.0
CONTROL_SERVICE = "edl_scale.Control"


class SimulatedPods(PodBackend):
    """A pod backend whose pods are the load generator's simulated workers: :meth:`start` records the id,
    :meth:`lose` queues the FAILED event a dead pod makes, :meth:`events` hands them to the master's loop."""

    def __init__(self) -> None:
        self._events: queue.Queue[PodEvent] = queue.Queue()
        self._lock = threading.Lock()
        self.started: list[int] = []

    def start(self, spec: PodSpec) -> None:
        with self._lock:
            self.started.append(spec.pod_id)

    def lose(self, worker_id: int) -> None:
        """Worker ``worker_id``'s pod died (its node went away): exit code 137, reason ``Error``."""
        event = PodEvent(
            PodRole.WORKER, worker_id, PodPhase.FAILED, 137, PodReason.KILLED, "vanished", time.time()
        )
        self._events.put(event)

    def delete(
        self, role: PodRole, pod_id: int, *, reason: str = PodReason.DELETED, grace_seconds: float = 5.0
    ) -> None:
        pass

    def events(self, timeout: float | None = None) -> list[PodEvent]:
        try:
            first = self._events.get(timeout=timeout)
        except queue.Empty:
            return []
        taken = [first]
        while not self._events.empty():
            taken.append(self._events.get_nowait())
        return taken

    def address(self, role: PodRole, pod_id: int) -> str:
        return ""

    def list_pods(self) -> list[PodStatus]:
        return []

    def adopt(self) -> list[PodStatus]:
        return []

    def close(self, *, grace_seconds: float = 5.0) -> None:
        pass


class MeteredStorage:
    """``storage`` with the bytes of every :meth:`write` counted (the state store's writes)."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self.bytes_written = 0
        self.writes = 0

    def write(self, key: str, data: bytes) -> None:
        self._storage.write(key, data)
        self.bytes_written += len(data)
        self.writes += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)


class SaveLog:
    """Every save of the state: when, how long its snapshot and its write took, and the bytes written."""

    def __init__(self, storage: MeteredStorage, write: Callable[[Mapping[str, Any]], None]) -> None:
        self._storage = storage
        self._write = write
        self.saves: list[tuple[float, float, float, int]] = []  # (at, snapshot s, write s, bytes)
        self._snapshot_seconds = 0.0

    def timed_snapshot(self, snapshot: Callable[[], Mapping[str, Any]]) -> Callable[[], Mapping[str, Any]]:
        def timed() -> Mapping[str, Any]:
            started = time.perf_counter()
            state = snapshot()
            self._snapshot_seconds = time.perf_counter() - started
            return state

        return timed

    def save(self, state: Mapping[str, Any]) -> None:
        before, started = self._storage.bytes_written, time.perf_counter()
        self._write(state)
        written = self._storage.bytes_written - before
        self.saves.append((time.time(), self._snapshot_seconds, time.perf_counter() - started, written))


def shard_name(index: int) -> str:
    """The name of the load run's shard ``index``."""
    return f"shard-{index:05d}"


def build_dispatcher(args: argparse.Namespace) -> TaskDispatcher:
    shards = {shard_name(i): args.shard_records for i in range(args.shards)}
    config = DispatcherConfig(
        records_per_task=args.records_per_task,
        num_epochs=args.epochs,
        shuffle=True,
        max_task_retries=args.max_task_retries,
    )
    return TaskDispatcher(shards, config)


def serve(args: argparse.Namespace) -> None:
    """Build the master, print ``PORT <master> <control>``, run its loop until killed."""
    log.configure("INFO")  # as `edl-argo train` does
    secret = secret_from_env()
    if secret is None:
        raise SystemExit(f"{SECRET_ENV} is not set: the load generator gives the master its job secret")
    dispatcher = build_dispatcher(args)
    shards = {shard_name(i): args.shard_records for i in range(args.shards)}
    config = TrainConfig(
        model_def="load.py",
        training_data="s3://load/train",
        output=args.state,
        num_epochs=args.epochs,
        minibatch_size=MINIBATCH_SIZE,
        num_minibatches_per_task=args.records_per_task // MINIBATCH_SIZE,
    )
    storage = MeteredStorage(open_storage(args.state))
    store = MasterStateStore(storage, JOB_NAME, job_fingerprint(config, shards, {}))  # type: ignore[arg-type]
    evaluation = EvaluationService(dict, {}, 0, dispatcher=dispatcher)
    parts = MasterParts(
        dispatcher, evaluation, VersionTracker(), TrainingLoss(), TrainingLedger(MINIBATCH_SIZE, 1), None
    )
    backend = SimulatedPods()
    pods = PodManager(
        backend,
        PodPolicy(num_workers=args.workers, num_ps=0, max_worker_relaunches=10**9),
        dispatcher,
        worker_spec=lambda i: PodSpec(PodRole.WORKER, i, ("simulated",)),
        ps_spec=lambda i: PodSpec(PodRole.PS, i, ("simulated",), port=1),
    )
    started_at = time.time()
    saves = SaveLog(storage, store.save)
    writer = GroupCommit(
        saves.timed_snapshot(
            lambda: state_to_save(parts, pods, started_at=started_at, master_port=0, ps_ports=[])
        ),
        saves.save,
        wait_seconds=RPC_TIMEOUT_SECONDS / 2,
    )
    server = make_server(
        limits=master_server_limits(RPC_TIMEOUT_SECONDS, args.workers),
        interceptors=[server_interceptor(secret, "master")],
    )
    servicer = DurableMasterServicer(
        dispatcher,
        evaluation,
        {TaskType.TRAINING: "s3://load/train", TaskType.EVALUATION: "", TaskType.PREDICTION: ""},
        current_version=lambda: parts.versions.version,
        on_version=parts.versions.observe,
        training_loss=parts.training_loss,
        ledger=parts.ledger,
        bounds=RequestBounds(is_worker=pods.is_worker),
        commit=writer,
        save_waiters=save_waiters(args.workers),
    )
    master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    pods.start()
    writer.start()
    server.start()

    loop_lock = threading.Lock()  # the master's loop: one thread handles pod events at a time

    def worker_lost(request: dict[str, Any]) -> dict[str, Any]:
        lost = int(request["worker_id"])
        backend.lose(lost)
        deadline = time.monotonic() + REPLACEMENT_WAIT_SECONDS
        while time.monotonic() < deadline:
            with loop_lock:
                for record in pods.relaunches:
                    if record.old_id == lost:
                        return {"replacement": record.new_id}
            time.sleep(LOOP_SECONDS / 2)
        return {"replacement": None}

    def stats(request: dict[str, Any]) -> dict[str, Any]:
        accounting = dispatcher.accounting()
        since = float(request.get("since", 0.0))
        return {
            "saves": [list(save) for save in saves.saves if save[0] >= since],
            "state_writes": storage.writes,
            "state_bytes": storage.bytes_written,
            "records_per_epoch": accounting.records_per_epoch,
            "records_done_per_epoch": {str(k): v for k, v in accounting.records_done_per_epoch.items() if v},
            "ledger_records_per_epoch": {str(k): v for k, v in parts.ledger.records_per_epoch().items()},
            "requeues": accounting.requeues,
            "tasks_done": accounting.tasks_done,
            "failure": str(dispatcher.failure) if dispatcher.failure else None,
            "writer_failure": repr(writer.failure) if writer.failure else None,
        }

    control = make_server(max_workers=4)
    control.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                CONTROL_SERVICE, {"WorkerLost": _json_method(worker_lost), "Stats": _json_method(stats)}
            ),
        )
    )
    control_port = control.add_insecure_port("127.0.0.1:0")
    control.start()
    print(f"PORT {port} {control_port}", flush=True)
    while True:  # the master's loop (edl_argo.master.job), as far as pods and timeouts go
        events = backend.events(timeout=LOOP_SECONDS)
        with loop_lock:
            if events:
                pods.handle(events)
                writer.changed()
            if dispatcher.reclaim_timed_out_tasks():
                writer.changed()
            if parts.ledger.fold_complete_epochs(
                dispatcher.accounting(epochs_begun_only=True), time.monotonic()
            ):
                writer.changed()


def _json_method(function: Callable[[dict[str, Any]], dict[str, Any]]) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        lambda request, _context: function(request),
        request_deserializer=json.loads,
        response_serializer=lambda value: json.dumps(value).encode(),
    )


def control_call(
    channel: grpc.Channel, method: str, request: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """Call ``method`` of the control server on ``channel`` with a deadline."""
    call = channel.unary_unary(
        f"/{CONTROL_SERVICE}/{method}",
        request_serializer=lambda value: json.dumps(value).encode(),
        response_deserializer=json.loads,
    )
    return call(request, timeout=timeout)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The job settings the master and the load generator share."""
    parser.add_argument("--records-per-task", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--max-task-retries", type=int, default=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--state", required=True, help="where the state is saved: a folder or s3://...")
    parser.add_argument("--workers", type=int, required=True, help="worker pods the master starts")
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--shard-records", type=int, default=5120)
    add_arguments(parser)
    serve(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
