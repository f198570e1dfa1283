"""The worker's task loop in one process: a real :class:`~edl_argo.worker.main.Worker` with its streaming
input pipeline, against the master's real servicer, dispatcher and ledger (called directly, no gRPC), and a
one-member AllreduceStrategy replica. (Whole jobs: tests/test_training_local.py and
tests/test_training_allreduce.py.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from edl_argo.data.commands import write_dataset
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.ledger import TrainingLedger
from edl_argo.master.rendezvous import RendezvousManager
from edl_argo.master.servicer import MasterServicer
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher, TaskType
from edl_argo.model import load_model_spec
from edl_argo.proto import master_pb2
from edl_argo.recordio import Compressor, open_dataset
from edl_argo.storage import LocalStorage
from edl_argo.worker.allreduce_replica import AllreduceReplica
from edl_argo.worker.main import READ_COUNTER, Worker
from edl_argo.worker.task_stream import TaskStream

MINIBATCH = 8
MINIBATCHES_PER_TASK = 3
#: Records per shard: tasks of 24 records, and the last of each shard 4 (a minibatch of another size).
SHARD_RECORDS = 100

#: A linear model on "x1,x2,x3,x4,y" text records; ``feed`` counts how often its map function is traced.
MODEL_FILE = """
import keras
import tensorflow as tf

PARSE_TRACES = []


def custom_model():
    inputs = keras.Input(shape=(4,), name="x")
    return keras.Model(inputs, keras.layers.Dense(1)(inputs))


def feed(dataset, mode, metadata):
    def parse(record):
        PARSE_TRACES.append(mode)
        values = tf.strings.to_number(tf.strings.split(record, ","))
        return values[:4], values[4:]

    return dataset.map(parse)


def loss(labels, predictions):
    return tf.reduce_mean(tf.square(labels - predictions))


def optimizer():
    return keras.optimizers.SGD(learning_rate=0.01)


def eval_metrics_fn():
    return {}
"""


class InProcessMaster:
    """What a worker's :class:`~edl_argo.worker.master_client.MasterClient` does, against a servicer in this
    process; ``on_report`` sees every task report before the servicer does."""

    def __init__(self, servicer: MasterServicer, rendezvous: RendezvousManager, worker_id: int) -> None:
        self._servicer = servicer
        self._rendezvous = rendezvous
        self.worker_id = worker_id
        self.reports: list[master_pb2.ReportTaskResultRequest] = []
        self.on_report = lambda request: None

    def get_task(self, held_task_ids: list[int] | tuple[int, ...] = ()) -> master_pb2.GetTaskResponse:
        request = master_pb2.GetTaskRequest(worker_id=self.worker_id, held_task_ids=list(held_task_ids))
        return self._servicer.GetTask(request, None)

    def report_task_result(
        self,
        task_id: int,
        success: bool,
        error: str = "",
        counters: dict[str, int] | None = None,
        mean_loss: float = 0.0,
        fatal: bool = False,
        next_task: bool = True,
        model_error: bool = False,
    ) -> master_pb2.ReportTaskResultResponse:
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
        self.on_report(request)
        self.reports.append(request)
        return self._servicer.ReportTaskResult(request, None)

    def report_version(self, model_version: int) -> None:
        pass

    def rendezvous(
        self,
        address: str,
        report: master_pb2.RendezvousRequest | None = None,
        budget_seconds: float | None = None,
    ) -> master_pb2.RendezvousResponse:
        return self._rendezvous.response(
            self._rendezvous.rendezvous(self.worker_id, address, report), self.worker_id
        )

    def report_collective_failure(self, round_id: int, suspect_worker_id: int, message: str) -> None:
        self._rendezvous.report_failure(self.worker_id, round_id, suspect_worker_id, message)


class Job:
    """A dataset, a master and one worker with a one-member allreduce group."""

    def __init__(
        self, tmp_path: Path, shards: int, epochs: int, bad_record: int = -1, max_task_retries: int = 3
    ) -> None:
        data = tmp_path / "data"
        records = [
            f"{i % 7},{i % 5},{i % 3},{i % 2},{i % 11}".encode() for i in range(SHARD_RECORDS * shards)
        ]
        if bad_record >= 0:
            records[bad_record] = b"1,2,not a number,4,5"
        write_dataset(LocalStorage(data), "", records, shards, Compressor.SNAPPY, overwrite=False)
        shard_sizes = open_dataset(LocalStorage(data)).records
        config = DispatcherConfig(
            records_per_task=MINIBATCH * MINIBATCHES_PER_TASK,
            num_epochs=epochs,
            max_task_retries=max_task_retries,
        )
        self.dispatcher = TaskDispatcher(shard_sizes, config)
        self.records_per_epoch = sum(shard_sizes.values())
        evaluation = EvaluationService(lambda: {}, {}, 1)
        evaluation.dispatcher = self.dispatcher
        self.ledger = TrainingLedger(MINIBATCH)
        urls = {TaskType.TRAINING: str(data), TaskType.EVALUATION: "", TaskType.PREDICTION: ""}
        rendezvous = RendezvousManager()
        servicer = MasterServicer(self.dispatcher, evaluation, urls, lambda: 0, ledger=self.ledger)
        self.master = InProcessMaster(servicer, rendezvous, worker_id=0)
        self.model_file = model_file = tmp_path / "model.py"
        model_file.write_text(MODEL_FILE)
        self.spec = load_model_spec(str(model_file))
        self.replica = AllreduceReplica(self.spec, self.master, "127.0.0.1", collective_timeout=20.0)
        self.worker = Worker(0, self.spec, self.master, self.replica, MINIBATCH)  # type: ignore[arg-type]

    def parse_traces(self) -> list[str]:
        return vars(self.spec.module)["PARSE_TRACES"]

    def close(self) -> None:
        self.replica.close()


@pytest.fixture
def job(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    created = Job(tmp_path, shards=2, epochs=getattr(request, "param", 2))
    yield created
    created.close()


@pytest.mark.parametrize("job", [4], indirect=True)
def test_no_tracing_after_warm_up_over_many_tasks_with_short_last_minibatches(job: Job) -> None:
    """The input function and the train step are traced during the first tasks only: over the remaining
    dozens of tasks (each shard's last task ends in a 4-record minibatch), the counts do not grow."""
    warm: dict[str, int] = {}
    sizes: list[int] = []

    def count_after_warm_up(request: master_pb2.ReportTaskResultRequest) -> None:
        sizes.append(request.counters["records"])
        if not warm and any(size % MINIBATCH for size in sizes):  # warm: a short minibatch was trained
            warm["parse"] = len(job.parse_traces())
            warm["step"] = job.replica._contribute.function.experimental_get_tracing_count()
            warm["tasks"] = len(sizes)

    job.master.on_report = count_after_warm_up
    job.worker.run()

    tasks = len(job.master.reports)
    assert tasks == 4 * 2 * 5  # 4 epochs × 2 shards × 5 tasks
    assert warm and warm["tasks"] < tasks / 2, f"the warm-up took {warm} of {tasks} tasks ({sizes})"
    assert len(job.parse_traces()) == warm["parse"] == 1
    assert job.replica._contribute.function.experimental_get_tracing_count() == warm["step"] <= 2


def test_every_task_is_reported_after_its_minibatches_and_the_ledger_adds_up(job: Job) -> None:
    """Reports come in task order, each after all its minibatches (the replica's version counts them; the
    reporter thread may send a report while the next task trains, so the version is at least, not exactly,
    the minibatches so far), with the records and minibatches the master's ledger expects; every epoch
    counts every record once."""
    versions: list[tuple[int, int]] = []
    job.master.on_report = lambda request: versions.append((request.counters["steps"], job.replica.version))
    job.worker.run()

    assert all(report.success for report in job.master.reports)
    assert job.dispatcher.finished
    steps = [s for s, _ in versions]
    trained_so_far = [sum(steps[: i + 1]) for i in range(len(steps))]
    reported_versions = [version for _, version in versions]
    assert all(v >= t for v, t in zip(reported_versions, trained_so_far, strict=True)), versions
    assert job.replica.version == trained_so_far[-1]
    reported_ids = [report.task_id for report in job.master.reports]
    assert reported_ids == sorted(set(reported_ids))
    assert set(steps) == {MINIBATCHES_PER_TASK, 1}
    assert job.ledger.records_per_epoch() == {epoch: job.records_per_epoch for epoch in range(2)}
    assert job.ledger.epoch_problems(job.dispatcher.accounting()) == []
    times = job.master.reports[-1].counters
    assert {"time_input_us", "time_compute_us", "time_master_us"} <= set(times)
    reads = [report.counters[READ_COUNTER] for report in job.master.reports]
    assert all(read > 0 for read in reads)  # every training task's read, timed on the stream's thread


def test_a_model_error_after_the_first_step_is_reported_as_one_naming_the_model_file_and_feed(
    tmp_path: Path,
) -> None:
    """A record of the second shard that feed cannot parse: the worker trained steps before, so the task is
    reported failed as a model error (the master fails the job when a second worker reports the same), not
    as fatal; the worker goes on, and the same worker failing it again is an ordinary retry."""
    job = Job(tmp_path, shards=2, epochs=1, bad_record=SHARD_RECORDS + 30, max_task_retries=2)
    try:
        job.worker.run()
    finally:
        job.close()
    failed = [report for report in job.master.reports if not report.success]
    assert len(failed) == 2 and {report.task_id for report in failed} == {failed[0].task_id}
    assert all(report.model_error and not report.fatal for report in failed)
    expected = f"model file {job.model_file}, function feed: InvalidArgumentError: "
    assert failed[0].error_message.startswith(expected), failed[0].error_message
    assert "\n" not in failed[0].error_message
    assert job.master.reports[0].success and job.master.reports[0].counters["steps"] == MINIBATCHES_PER_TASK
    assert job.dispatcher.failure is not None and "failed 2 times" in str(job.dispatcher.failure)
    assert expected in str(job.dispatcher.failure)


class _Tasks:
    """A master with endless training tasks, counting the requests and the tasks each listed as held."""

    def __init__(self) -> None:
        self.requests: list[list[int]] = []

    def get_task(self, held_task_ids: list[int]) -> master_pb2.GetTaskResponse:
        self.requests.append(list(held_task_ids))
        task = master_pb2.Task(task_id=len(self.requests), type=master_pb2.TRAINING, data_url="d", shard="s")
        return master_pb2.GetTaskResponse(kind=master_pb2.GetTaskResponse.TASK, task=task)


class _Records:
    def read(self, data_url: str, shard: str, start: int, end: int, version: str = "") -> list[bytes]:
        return [b"r"]


def test_the_stream_reads_one_task_ahead_and_no_further_until_a_task_is_finished() -> None:
    master = _Tasks()
    stream = TaskStream(master, _Records())  # type: ignore[arg-type]
    generator = stream.generate()
    assert [next(generator)[0], next(generator)[0]] == [0, 1]  # the current task and one ahead
    third: list[int] = []
    reader = threading.Thread(target=lambda: third.append(next(generator)[0]), daemon=True)
    reader.start()
    reader.join(1.0)
    assert reader.is_alive() and master.requests == [[], [1]]  # the master knows which tasks it holds
    stream.finished(0)
    reader.join(10.0)
    assert third == [2] and master.requests[-1] == [2]
    stream.close()


def test_the_next_task_is_fetched_while_the_current_one_runs_not_when_the_pipeline_asks() -> None:
    master = _Tasks()
    stream = TaskStream(master, _Records())  # type: ignore[arg-type]
    generator = stream.generate()
    try:
        assert next(generator)[0] == 0
        deadline = time.monotonic() + 10.0
        while len(master.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert master.requests == [[], [1]]  # asked for task 1 while task 0 runs, nothing pulled since
        time.sleep(0.2)
        assert len(master.requests) == 2  # and no further: task 0 is not finished
        with pytest.raises(RuntimeError, match="generated once"):
            next(stream.generate())  # a second fetcher would hold tasks no pipeline reads
    finally:
        stream.close()
