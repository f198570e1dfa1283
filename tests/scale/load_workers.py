"""Simulated workers of a load run, many in one process: ``python -m tests.scale.load_workers ...`` runs one
thread per worker id of ``--first-id`` .. ``--first-id + --count - 1`` and writes what they saw as JSON to
``--output``. No TensorFlow: a worker holds a task for as long as training it would take.

Each follows the real worker's protocol (:mod:`edl_argo.worker.task_stream`, :mod:`edl_argo.worker.main`):
its own channel with its own credential (``worker-<id>``'s token under the job secret of
``EDL_JOB_SECRET``), every call through :func:`~edl_argo.rpc.channel.call_with_retry` with the worker's
deadline and retry budget. It asks for a task, and while it trains one it asks for the next, listing the
one it holds (one task ahead, as ``TaskStream``). A task of ``n`` records takes ``n`` × a per-record pace
drawn per task from a lognormal distribution (median ``--pace-ms``, shape ``--pace-sigma``); then it
reports it (``ReportTaskResult`` without asking for the next, as the worker's reporter does) with the
counters a worker sends (records, minibatches of 64). With probability ``--fail-rate`` a task fails instead
(reported as failed after part of its time, with the minibatches it trained); with probability
``--vanish-rate`` the worker vanishes mid-task: it never reports, its pod's death is told to the master
(``WorkerLost``, see :mod:`tests.scale.load_master`) after ``--detect-seconds``, and the thread comes back
as the replacement the master started, ``--pod-start-seconds`` later. A call failing with an error the real
worker does not retry (anything but UNAVAILABLE and DEADLINE_EXCEEDED, or those past the budget) ends that
worker as a crash ends its pod: counted, and reported like a vanished one.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from edl_argo.proto import master_pb2, master_pb2_grpc
from edl_argo.rpc.auth import JobSecret, pod_identity, secret_from_env
from edl_argo.rpc.channel import call_with_retry, make_channel
from tests.scale.load_master import MINIBATCH_SIZE, RPC_TIMEOUT_SECONDS, control_call

#: The worker's retry budget for a master call (``MasterClient``'s default).
RETRY_BUDGET_SECONDS = 300.0
#: How long a worker told WAIT waits before it asks again.
WAIT_SECONDS = 1.0
THREAD_STACK_BYTES = 256 * 1024

Response = TypeVar("Response")


@dataclass(frozen=True)
class Behaviour:
    """How simulated workers train, fail and vanish."""

    pace_ms: float
    pace_sigma: float
    fail_rate: float
    vanish_rate: float
    detect_seconds: float
    pod_start_seconds: float


@dataclass
class Seen:
    """What one process's workers saw; merged over processes by the load generator."""

    get_task_s: list[float] = field(default_factory=list)
    report_s: list[float] = field(default_factory=list)
    handed_out_at: list[float] = field(default_factory=list)
    #: ``[shard, start, end, epoch]`` of every successful report the master accepted.
    accepted: list[list[Any]] = field(default_factory=list)
    #: Those of successful reports answered "not accepted" after a retry: the first attempt may have been
    #: accepted, its answer lost (the master counts it; its answer to the retry is "not held").
    retried_not_accepted: list[list[Any]] = field(default_factory=list)
    reports_not_accepted: int = 0
    failed_reports: int = 0
    vanished: int = 0
    crashed: list[str] = field(default_factory=list)
    waits: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


class WorkerGone(Exception):
    """The simulated worker's pod is gone (vanished or crashed)."""


class SimulatedWorker:
    """One worker thread's life, through its replacements, until ``stop_at`` (``time.time()``)."""

    def __init__(
        self,
        worker_id: int,
        master: str,
        control: grpc.Channel,
        secret: JobSecret,
        behaviour: Behaviour,
        stop_at: float,
        seen: Seen,
        lock: threading.Lock,
    ) -> None:
        self.worker_id = worker_id
        self._master = master
        self._control = control
        self._secret = secret
        self._behaviour = behaviour
        self._stop_at = stop_at
        self._seen = seen
        self._lock = lock
        self._random = random.Random(worker_id)
        self._stub: master_pb2_grpc.MasterStub | None = None
        self._channel: grpc.Channel | None = None

    def run(self) -> None:
        try:
            self._live()
        except Exception as error:  # a bug of the harness: counted as a crash, never silent
            with self._lock:
                self._seen.crashed.append(f"worker {self.worker_id}: {type(error).__name__}: {error}")
            raise

    def _live(self) -> None:
        time.sleep(self._random.uniform(0, 2.0))  # pods start over a few seconds, not at one instant
        while time.time() < self._stop_at:
            self._connect()
            try:
                self._work()
            except WorkerGone as gone:
                if not self._replace(str(gone)):
                    return
        self._close()

    def _connect(self) -> None:
        self._close()
        credential = self._secret.credential(pod_identity("worker", self.worker_id))
        self._channel = make_channel(self._master, credential, own_connection=True)
        self._stub = master_pb2_grpc.MasterStub(self._channel)

    def _close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _replace(self, why: str) -> bool:
        """Tell the master this worker's pod died; become its replacement. False if there is none."""
        time.sleep(self._behaviour.detect_seconds)
        answer = control_call(self._control, "WorkerLost", {"worker_id": self.worker_id}, RPC_TIMEOUT_SECONDS)
        if answer.get("replacement") is None:
            with self._lock:
                self._seen.crashed.append(f"worker {self.worker_id} ({why}): no replacement started")
            return False
        self.worker_id = int(answer["replacement"])
        time.sleep(self._behaviour.pod_start_seconds)
        return True

    def _call(self, timings: list[float], rpc: Callable[[float], Response]) -> tuple[Response, int]:
        """``rpc`` with the worker's retries: its answer and how many attempts it took."""
        started, attempts, attempt_started = time.perf_counter(), 0, 0.0

        def attempt(timeout: float) -> Response:
            nonlocal attempts, attempt_started
            attempts += 1
            attempt_started = time.perf_counter()
            return rpc(timeout)

        try:
            response = call_with_retry(
                attempt, f"master {self._master}", RETRY_BUDGET_SECONDS, RPC_TIMEOUT_SECONDS
            )
        except grpc.RpcError as error:
            with self._lock:
                self._seen.crashed.append(
                    f"worker {self.worker_id}: {error.code().name} {error.details()} (attempt {attempts},"
                    f" after {time.perf_counter() - attempt_started:.1f} s of {RPC_TIMEOUT_SECONDS:g})"
                )
            raise WorkerGone("crashed") from None
        elapsed = time.perf_counter() - started
        with self._lock:
            timings.append(elapsed)
        return response, attempts

    def _get_task(self, held: list[int]) -> master_pb2.GetTaskResponse:
        assert self._stub is not None
        request = master_pb2.GetTaskRequest(worker_id=self.worker_id, held_task_ids=held)
        response, _ = self._call(
            self._seen.get_task_s, lambda timeout: self._stub.GetTask(request, timeout=timeout)
        )
        if response.kind == master_pb2.GetTaskResponse.TASK:
            with self._lock:
                self._seen.handed_out_at.append(time.time())
        return response

    def _work(self) -> None:
        current = self._get_task([])
        while time.time() < self._stop_at:
            if current.kind == master_pb2.GetTaskResponse.DONE:
                return
            if current.kind == master_pb2.GetTaskResponse.WAIT:
                with self._lock:
                    self._seen.waits += 1
                time.sleep(WAIT_SECONDS)
                current = self._get_task([])
                continue
            current = self._train(current.task)

    def _train(self, task: master_pb2.Task) -> master_pb2.GetTaskResponse:
        """Train ``task`` (asking for the next one meanwhile), report it; the next task."""
        behaviour, records = self._behaviour, task.end - task.start
        pace = behaviour.pace_ms / 1000 * math.exp(self._random.gauss(0.0, behaviour.pace_sigma))
        seconds, started = records * pace, time.monotonic()
        following = self._get_task([task.task_id])
        held = [task.task_id] + ([following.task.task_id] if following.kind == following.TASK else [])
        draw = self._random.random()
        if draw < behaviour.vanish_rate:
            time.sleep(self._random.uniform(0, seconds))
            with self._lock:
                self._seen.vanished += 1
            raise WorkerGone(f"vanished holding tasks {held}")
        failed = draw < behaviour.vanish_rate + behaviour.fail_rate
        share = self._random.uniform(0, 1) if failed else 1.0
        time.sleep(max(0.0, started + seconds * share - time.monotonic()))
        trained = int(records * share)
        counters = {"records": trained, "steps": -(-trained // MINIBATCH_SIZE)}
        request = master_pb2.ReportTaskResultRequest(
            worker_id=self.worker_id,
            task_id=task.task_id,
            success=not failed,
            error_message="simulated failure" if failed else "",
            counters=counters,
        )
        answer, attempts = self._call(
            self._seen.report_s, lambda timeout: self._stub.ReportTaskResult(request, timeout=timeout)
        )
        with self._lock:
            if failed:
                self._seen.failed_reports += 1
            elif answer.accepted:
                self._seen.accepted.append([task.shard, task.start, task.end, task.epoch])
            elif attempts > 1:
                self._seen.retried_not_accepted.append([task.shard, task.start, task.end, task.epoch])
            else:
                self._seen.reports_not_accepted += 1
        return following


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--master", required=True)
    parser.add_argument("--control", required=True)
    parser.add_argument("--first-id", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--stop-at", type=float, required=True, help="time.time() at which workers stop")
    parser.add_argument("--output", required=True)
    parser.add_argument("--pace-ms", type=float, required=True)
    parser.add_argument("--pace-sigma", type=float, required=True)
    parser.add_argument("--fail-rate", type=float, required=True)
    parser.add_argument("--vanish-rate", type=float, required=True)
    parser.add_argument("--detect-seconds", type=float, default=1.0)
    parser.add_argument("--pod-start-seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    secret = secret_from_env()
    if secret is None:
        raise SystemExit("EDL_JOB_SECRET is not set")
    behaviour = Behaviour(
        args.pace_ms,
        args.pace_sigma,
        args.fail_rate,
        args.vanish_rate,
        args.detect_seconds,
        args.pod_start_seconds,
    )
    seen, lock = Seen(), threading.Lock()
    control = grpc.insecure_channel(args.control)
    threading.stack_size(THREAD_STACK_BYTES)
    threads = [
        threading.Thread(
            target=SimulatedWorker(
                worker_id, args.master, control, secret, behaviour, args.stop_at, seen, lock
            ).run,
            daemon=True,
        )
        for worker_id in range(args.first_id, args.first_id + args.count)
    ]
    for thread in threads:
        thread.start()
    print("PORT 0", flush=True)  # started (the load generator waits for every process's first line)
    grace = RPC_TIMEOUT_SECONDS + 10
    for thread in threads:
        thread.join(timeout=max(0.0, args.stop_at + grace - time.time()))
    with lock:
        stuck = sum(thread.is_alive() for thread in threads)
        if stuck:
            seen.crashed.append(f"{stuck} workers still busy {grace:g} s after the stop")
        with open(args.output, "w") as output:
            json.dump(seen.to_json(), output)
    control.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
