"""A master killed at any point of an evaluation round: the restarted master always ends the job with its
final metrics, each validation record counted exactly once.

The real dispatcher, evaluation service and master service run a small job (periodic rounds and the final
round) with simulated workers. The master's state is saved as :meth:`TrainingJob._state` does: the
dispatcher's snapshot, then the evaluation's, taken by another thread at any moment, so any number of
changes may come between the two. The test records both snapshots at every point where the master's
threads release a lock (every point another thread could take a snapshot at) and restores a new master
from every pair (dispatcher at point i, evaluation at point j >= i), with the workers surviving or not.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.state_store import DurableMasterServicer
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType, held_tasks
from edl_argo.proto import master_pb2
from edl_argo.rpc.tensors import to_tensor

#: Validation records: shard -> count. A record's value is unique (a power of two), so a record counted
#: twice or missed changes the metric.
VALIDATION = {"v0": 3, "v1": 2}
VALUES = {("v0", 0): 1.0, ("v0", 1): 2.0, ("v0", 2): 4.0, ("v1", 0): 8.0, ("v1", 1): 16.0}
EXPECTED_MEAN = sum(VALUES.values()) / len(VALUES)
TRAINING = {"t0": 8}
RECORDS_PER_TASK = 2  # 4 training tasks per epoch; evaluation tasks of 2, 1 and 2 records
EVALUATION_STEPS = 3
MAX_TICKS = 200


def metrics() -> dict[str, Any]:
    return {"mean_value": lambda labels, outputs: np.asarray(labels, dtype=np.float64).ravel()}


class _NoCommit:
    """The state writer's interface; saving is what the test does itself, at every point."""

    def commit(self) -> bool:
        return True

    def changed(self) -> None:
        pass


class RecordingLock:
    """A lock that calls ``on_release`` once its thread holds none of the recording locks any more."""

    holders: dict[int, int] = {}

    def __init__(self, on_release: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._on_release = on_release

    def __enter__(self) -> RecordingLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        acquired = self._lock.acquire(blocking, timeout)
        if acquired:
            me = threading.get_ident()
            RecordingLock.holders[me] = RecordingLock.holders.get(me, 0) + 1
        return acquired

    def release(self) -> None:
        me = threading.get_ident()
        RecordingLock.holders[me] -= 1
        self._lock.release()
        if RecordingLock.holders[me] == 0:
            self._on_release()


@dataclass
class Master:
    dispatcher: TaskDispatcher
    evaluation: EvaluationService
    servicer: DurableMasterServicer
    version: list[int] = field(default_factory=lambda: [0])


def new_master(saved: tuple[dict[str, Any], dict[str, Any], int] | None, live: set[int]) -> Master:
    evaluation = EvaluationService(metrics, VALIDATION, EVALUATION_STEPS)
    config = DispatcherConfig(records_per_task=RECORDS_PER_TASK, num_epochs=1)
    if saved is None:
        dispatcher = TaskDispatcher(TRAINING, config, on_evaluation_complete=evaluation.round_complete)
    else:
        dispatcher = TaskDispatcher.restore(
            saved[0], on_evaluation_complete=evaluation.round_complete, live_workers=live
        )
    evaluation.dispatcher = dispatcher
    version = [0 if saved is None else saved[2]]

    def on_version(reported: int) -> None:
        version[0] = max(version[0], reported)
        evaluation.on_model_version(version[0])

    if saved is not None:
        evaluation.restore(saved[1])
    servicer = DurableMasterServicer(
        dispatcher,
        evaluation,
        {TaskType.TRAINING: "train", TaskType.EVALUATION: "validation", TaskType.PREDICTION: ""},
        current_version=lambda: version[0],
        on_version=on_version,
        commit=_NoCommit(),
    )
    return Master(dispatcher, evaluation, servicer, version)


@dataclass
class Worker:
    """A worker: asks for a task, then (evaluation) reports outputs, then reports the result."""

    worker_id: int
    task: master_pb2.Task | None = None
    outputs_reported: bool = False
    done: bool = False

    def tick(self, master: Master) -> None:
        servicer = master.servicer
        if self.done:
            return
        if self.task is None:
            response = servicer.GetTask(master_pb2.GetTaskRequest(worker_id=self.worker_id), None)
            if response.kind == master_pb2.GetTaskResponse.DONE:
                self.done = True
            elif response.kind == master_pb2.GetTaskResponse.TASK:
                self.task, self.outputs_reported = response.task, False
            return
        task = self.task
        if task.type == master_pb2.EVALUATION and not self.outputs_reported:
            values = np.array([VALUES[(task.shard, r)] for r in range(task.start, task.end)], np.float32)
            servicer.ReportEvaluationOutputs(
                master_pb2.ReportEvaluationOutputsRequest(
                    worker_id=self.worker_id,
                    task_id=task.task_id,
                    model_version=task.model_version,
                    outputs=[to_tensor(values.reshape(-1, 1))],
                    labels=to_tensor(values),
                ),
                None,
            )
            self.outputs_reported = True
            return
        counters = {}
        if task.type == master_pb2.TRAINING:
            master.version[0] += 1  # the model the worker trained: one version per task
            counters = {"steps": 1, "epoch": task.epoch, "model_version": master.version[0]}
        servicer.ReportTaskResult(
            master_pb2.ReportTaskResultRequest(
                worker_id=self.worker_id, task_id=task.task_id, success=True, counters=counters
            ),
            None,
        )
        self.task = None


def run(master: Master, workers: list[Worker], what: str) -> None:
    for _ in range(MAX_TICKS):
        for worker in workers:
            worker.tick(master)
        if all(worker.done for worker in workers):
            break
    else:
        pytest.fail(
            f"{what}: the job did not end in {MAX_TICKS} rounds of worker calls (master waits forever)"
        )
    assert master.dispatcher.finished and master.evaluation.final_done, what
    finals = [record for record in master.evaluation.history if record.final]
    assert finals, f"{what}: no final evaluation"
    assert finals[-1].records == len(VALUES), what
    assert finals[-1].metrics["mean_value"] == pytest.approx(EXPECTED_MEAN), what
    for record in master.evaluation.history:
        assert record.records == len(VALUES), f"{what}: round of version {record.model_version} {record}"


def record_a_job() -> list[tuple[dict[str, Any], dict[str, Any], int]]:
    """Run the job once, recording (dispatcher snapshot, evaluation snapshot, version) at every point."""
    points: list[tuple[dict[str, Any], dict[str, Any], int]] = []
    recording = [True]
    master: Master | None = None

    def capture() -> None:
        if master is None or not recording[0]:
            return
        recording[0] = False  # snapshots take the locks themselves
        try:
            state = (master.dispatcher.snapshot(), master.evaluation.snapshot(), master.version[0])
            points.append(json.loads(json.dumps(state)))  # as it reads back from the state file
        finally:
            recording[0] = True

    master = new_master(None, set())
    master.dispatcher._lock = RecordingLock(capture)  # type: ignore[assignment]
    master.evaluation._lock = RecordingLock(capture)  # type: ignore[assignment]
    run(master, [Worker(1), Worker(2)], "the job without a restart")
    assert len(master.evaluation.history) >= 2  # periodic rounds and the final one
    return points


def surviving_workers(master: Master, dispatcher_state: dict[str, Any], survivors: set[int]) -> list[Worker]:
    """The workers after the restart: the survivors, each going on with the task it held (all of it:
    its last reply may have been lost), or two new workers when none survived."""
    held = {int(entry["worker_id"]): int(entry["task"]["task_id"]) for entry in held_tasks(dispatcher_state)}
    workers = [Worker(w) for w in sorted(survivors)] or [Worker(3), Worker(4)]
    for worker in workers:
        if worker.worker_id in held:
            task = master.dispatcher.held_task(held[worker.worker_id], worker.worker_id)
            worker.task = master.servicer._to_proto(task)
    return workers


#: How many points apart the two snapshots of one save are tried when no worker survives (every distance
#: when they do).
SHORT_DISTANCE = 12


def test_a_master_restarted_at_any_point_of_an_evaluation_round_ends_with_its_final_metrics() -> None:
    points = record_a_job()
    in_rounds = [
        p for p in points if p[0]["evaluations_pending"] or p[1]["rounds"] or p[1]["final_requested"]
    ]
    assert len(in_rounds) > 20, "the recorded job has points inside evaluation rounds"
    restores = 0
    for i, (dispatcher_state, _, version) in enumerate(points):
        for j in range(i, len(points)):
            for survivors in ({1, 2}, set()) if j - i <= SHORT_DISTANCE else ({1, 2},):
                saved = (dispatcher_state, points[j][1], max(version, points[j][2]))
                master = new_master(json.loads(json.dumps(saved)), survivors)
                workers = surviving_workers(master, dispatcher_state, survivors)
                what = f"restart from the dispatcher of point {i} and the evaluation of point {j}"
                run(master, workers, f"{what}, surviving workers {sorted(survivors)}")
                restores += 1
    assert restores > 1000
