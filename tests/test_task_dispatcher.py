"""Tests for the master's dynamic-sharding bookkeeping (``edl_argo.master.task_dispatcher``)."""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections import defaultdict
from collections.abc import Mapping

import pytest

from edl_argo.errors import ConfigError, DataFormatError, JobFailedError
from edl_argo.master.task_dispatcher import (
    DONE,
    WAIT,
    DispatcherConfig,
    Task,
    TaskAssignment,
    TaskDispatcher,
    TaskType,
    held_tasks,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(shards: Mapping[str, int], *, clock: FakeClock | None = None, **config: object) -> TaskDispatcher:
    settings: dict[str, object] = {"records_per_task": 4, "num_epochs": 1}
    settings.update(config)
    return TaskDispatcher(shards, DispatcherConfig(**settings), clock=clock or FakeClock())  # type: ignore[arg-type]


def take(dispatcher: TaskDispatcher, worker_id: int = 0) -> Task:
    assignment = dispatcher.get_task(worker_id)
    assert assignment.kind == "task", assignment
    assert assignment.task is not None
    return assignment.task


def drain(dispatcher: TaskDispatcher, worker_id: int = 0) -> list[Task]:
    """Get and successfully report tasks one at a time until DONE; return them in dispatch order."""
    tasks = []
    while (assignment := dispatcher.get_task(worker_id)).kind == "task":
        assert assignment.task is not None
        assert dispatcher.report(assignment.task.task_id, worker_id, success=True)
        tasks.append(assignment.task)
    assert assignment == DONE
    return tasks


def assert_covered_once(ranges: list[tuple[str, int, int]], shards: Mapping[str, int]) -> None:
    """``ranges`` cover every record of every shard exactly once."""
    by_shard: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for shard, start, end in ranges:
        by_shard[shard].append((start, end))
    for shard, size in shards.items():
        position = 0
        for start, end in sorted(by_shard.pop(shard, [])):
            assert start == position, (
                f"shard {shard}: gap or overlap at record {position} (next range {start})"
            )
            position = end
        assert position == size, f"shard {shard}: records [{position}, {size}) never done"
    assert not by_shard, f"ranges of unknown shards {sorted(by_shard)}"


def assert_no_record_lost(dispatcher: TaskDispatcher, num_epochs: int) -> None:
    accounting = dispatcher.accounting()
    assert dispatcher.finished and dispatcher.failure is None
    assert accounting.records_done_per_epoch == dict.fromkeys(range(num_epochs), accounting.records_per_epoch)
    assert accounting.tasks_done == accounting.tasks_total
    done, total = dispatcher.progress()
    assert done == total


# ---------------------------------------------------------------- configuration and cutting


def test_tasks_are_cut_per_shard_with_a_short_last_task_and_none_for_empty_shards() -> None:
    dispatcher = make({"a": 10, "empty": 0, "c": 3})
    tasks = drain(dispatcher)
    assert [(t.shard, t.start, t.end, t.num_records) for t in tasks] == [
        ("a", 0, 4, 4),
        ("a", 4, 8, 4),
        ("a", 8, 10, 2),
        ("c", 0, 3, 3),
    ]
    assert [t.task_id for t in tasks] == [1, 2, 3, 4]
    assert all(t.type is TaskType.TRAINING and t.epoch == 0 and t.model_version == -1 for t in tasks)
    assert dispatcher.accounting().records_per_epoch == 13


def test_shard_size_that_is_an_exact_multiple_gives_full_tasks_only() -> None:
    tasks = drain(make({"a": 8}))
    assert [(t.start, t.end) for t in tasks] == [(0, 4), (4, 8)]


@pytest.mark.parametrize("shards", [{}, {"empty": 0}])
def test_empty_dataset_is_done_at_once(shards: dict[str, int]) -> None:
    dispatcher = make(shards, num_epochs=3)
    assert dispatcher.get_task(0) == DONE
    assert dispatcher.finished
    assert dispatcher.progress() == (0, 0)


@pytest.mark.parametrize(
    "config",
    [
        {"records_per_task": 0, "num_epochs": 1},
        {"records_per_task": 4, "num_epochs": -1},
        {"records_per_task": 4, "num_epochs": 1, "max_task_retries": 0},
        {"records_per_task": 4, "num_epochs": 1, "task_timeout_floor": 0},
    ],
)
def test_invalid_config_is_a_config_error(config: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        DispatcherConfig(**config)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [-1, 2.5, "7"])
def test_invalid_shard_size_is_a_config_error_naming_the_shard(size: object) -> None:
    with pytest.raises(ConfigError, match="shard bad"):
        make({"good": 3, "bad": size})  # type: ignore[dict-item]


def test_assignment_kind_and_task_must_agree() -> None:
    with pytest.raises(ValueError):
        TaskAssignment("task")
    with pytest.raises(ValueError):
        TaskAssignment("wait", Task(1, TaskType.TRAINING, "a", 0, 1))


# ---------------------------------------------------------------- epochs and shuffling


def test_epochs_are_created_lazily_and_exactly_num_epochs() -> None:
    dispatcher = make({"a": 8}, num_epochs=3)
    assert dispatcher.progress() == (0, 6)  # known up front
    assert dispatcher.snapshot()["epochs_created"] == 0
    first, second = take(dispatcher, 1), take(dispatcher, 2)
    assert (first.epoch, second.epoch) == (0, 0)
    assert dispatcher.snapshot()["epochs_created"] == 1
    # The todo queue drained: the next epoch starts while epoch 0 is still being trained.
    third = take(dispatcher, 3)
    assert third.epoch == 1
    assert dispatcher.snapshot()["epochs_created"] == 2
    for task, worker in ((first, 1), (second, 2), (third, 3)):
        assert dispatcher.report(task.task_id, worker, success=True)
    rest = drain(dispatcher)
    assert [t.epoch for t in rest] == [1, 2, 2]
    assert dispatcher.snapshot()["epochs_created"] == 3
    ids = [t.task_id for t in (first, second, third, *rest)]
    assert len(set(ids)) == len(ids)
    assert_no_record_lost(dispatcher, 3)


def test_the_saved_state_grows_with_the_epochs_started_not_with_num_epochs() -> None:
    """A job asked for many epochs (or one that repeats a small dataset) saves its state after every report:
    the snapshot must not carry a counter per epoch not yet started."""
    sizes = []
    for num_epochs in (2, 1_000_000):
        dispatcher = make({"a": 8}, num_epochs=num_epochs)
        task = take(dispatcher)
        assert dispatcher.report(task.task_id, 0, success=True)
        sizes.append(len(json.dumps(dispatcher.snapshot())))
        restored = TaskDispatcher.restore(json.loads(json.dumps(dispatcher.snapshot())), clock=FakeClock())
        accounting = restored.accounting()
        assert len(accounting.records_done_per_epoch) == num_epochs  # the accounting still names each
        assert accounting.records_done_per_epoch[0] == 4 and accounting.records_done_per_epoch[1] == 0
    assert sizes[1] - sizes[0] < 16, sizes  # the digits of num_epochs in the config


def test_the_accounting_of_the_epochs_begun_costs_what_they_do_not_num_epochs() -> None:
    """The master folds complete epochs and exports metrics from the accounting on every tick: the view it
    reads then names the epochs begun, and with them the same counts as the whole accounting."""
    dispatcher = make({"a": 8}, num_epochs=1_000_000)
    assert dispatcher.accounting(epochs_begun_only=True).records_done_per_epoch == {}
    first = take(dispatcher)
    assert dispatcher.report(first.task_id, 0, success=True)
    begun = dispatcher.accounting(epochs_begun_only=True)
    assert begun.records_done_per_epoch == {0: 4}
    assert dataclasses.replace(begun, records_done_per_epoch={}) == dataclasses.replace(
        dispatcher.accounting(), records_done_per_epoch={}
    )


def _order(seed: int, num_epochs: int = 2) -> list[list[tuple[str, int]]]:
    dispatcher = make(
        {"a": 60, "b": 45, "c": 1}, records_per_task=3, num_epochs=num_epochs, shuffle=True, seed=seed
    )
    epochs: list[list[tuple[str, int]]] = [[] for _ in range(num_epochs)]
    for task in drain(dispatcher):
        epochs[task.epoch].append((task.shard, task.start))
    return epochs


def test_shuffle_is_deterministic_by_seed_and_differs_between_epochs() -> None:
    first = _order(seed=7)
    assert first == _order(seed=7)
    assert first != _order(seed=8)
    assert first[0] != first[1]
    assert sorted(first[0]) == sorted(first[1])
    unshuffled = [(t.shard, t.start) for t in drain(make({"a": 60, "b": 45, "c": 1}, records_per_task=3))]
    assert first[0] != unshuffled and sorted(first[0]) == sorted(unshuffled)


# ---------------------------------------------------------------- WAIT, DONE and priorities


def test_wait_while_tasks_are_held_then_done() -> None:
    dispatcher = make({"a": 4})
    task = take(dispatcher, 1)
    assert dispatcher.get_task(2) == WAIT
    assert not dispatcher.finished
    assert dispatcher.report(task.task_id, 1, success=True)
    assert dispatcher.get_task(2) == DONE
    assert dispatcher.finished and dispatcher.failure is None


def test_evaluation_then_prediction_tasks_come_before_training_tasks() -> None:
    completed: list[int] = []
    dispatcher = TaskDispatcher(
        {"train": 8},
        DispatcherConfig(records_per_task=4, num_epochs=1),
        clock=FakeClock(),
        on_evaluation_complete=completed.append,
    )
    training = take(dispatcher)
    assert dispatcher.create_prediction_tasks({"p": 3}) == 1
    assert dispatcher.create_evaluation_tasks({"e1": 5, "e2": 0}, model_version=12) == 2
    assert dispatcher.evaluation_pending(12)
    got = [take(dispatcher, worker) for worker in (1, 2, 3, 4)]
    assert [(t.type, t.shard, t.start, t.end) for t in got] == [
        (TaskType.EVALUATION, "e1", 0, 4),
        (TaskType.EVALUATION, "e1", 4, 5),
        (TaskType.PREDICTION, "p", 0, 3),
        (TaskType.TRAINING, "train", 4, 8),
    ]
    assert [t.model_version for t in got] == [12, 12, -1, -1]
    assert dispatcher.report(got[0].task_id, 1, success=True)
    assert completed == [] and dispatcher.evaluation_pending(12)
    assert dispatcher.report(got[1].task_id, 2, success=True)
    assert completed == [12] and not dispatcher.evaluation_pending(12)
    for task, worker in ((training, 0), (got[2], 3), (got[3], 4)):
        assert dispatcher.report(task.task_id, worker, success=True)
    assert dispatcher.get_task(0) == DONE
    accounting = dispatcher.accounting()
    assert (accounting.tasks_done, accounting.tasks_total) == (5, 5)
    assert dispatcher.progress() == (2, 2)


def test_pending_evaluation_keeps_workers_waiting_after_training() -> None:
    completed: list[int] = []
    dispatcher = TaskDispatcher(
        {"train": 4},
        DispatcherConfig(records_per_task=4, num_epochs=1),
        clock=FakeClock(),
        on_evaluation_complete=completed.append,
    )
    drain_first = take(dispatcher, 1)
    dispatcher.create_evaluation_tasks({"e": 4}, model_version=3)
    evaluation = take(dispatcher, 2)
    assert dispatcher.report(drain_first.task_id, 1, success=True)
    assert dispatcher.get_task(1) == WAIT
    assert dispatcher.report(evaluation.task_id, 2, success=True)
    assert dispatcher.get_task(1) == DONE
    assert completed == [3]


def test_empty_evaluation_round_completes_at_once() -> None:
    completed: list[int] = []
    dispatcher = TaskDispatcher(
        {"train": 4},
        DispatcherConfig(records_per_task=4, num_epochs=1),
        clock=FakeClock(),
        on_evaluation_complete=completed.append,
    )
    assert dispatcher.create_evaluation_tasks({"e": 0}, model_version=5) == 0
    assert completed == [5] and not dispatcher.evaluation_pending(5)


def test_evaluation_callback_may_call_back_into_the_dispatcher() -> None:
    dispatcher: TaskDispatcher

    def next_round(version: int) -> None:
        if version < 3:
            dispatcher.create_evaluation_tasks({"e": 2}, model_version=version + 1)

    dispatcher = TaskDispatcher(
        {},
        DispatcherConfig(records_per_task=4, num_epochs=0),
        clock=FakeClock(),
        on_evaluation_complete=next_round,
    )
    dispatcher.create_evaluation_tasks({"e": 2}, model_version=1)
    assert [t.model_version for t in drain(dispatcher)] == [1, 2, 3]


# ---------------------------------------------------------------- failures and retries


def test_failed_task_goes_back_to_the_front_and_the_job_fails_after_max_retries() -> None:
    dispatcher = make({"s3://bucket/part-0": 12}, max_task_retries=3)
    task = take(dispatcher, 1)
    assert dispatcher.report(task.task_id, 1, success=False, error="oops 1")
    assert take(dispatcher, 2) == task  # same task, same id, at the front
    assert dispatcher.report(task.task_id, 2, success=False, error="oops 2")
    assert dispatcher.failure is None
    assert take(dispatcher, 1) == task
    assert dispatcher.report(task.task_id, 1, success=False, error="CUDA error:\n out of memory")
    failure = dispatcher.failure
    assert isinstance(failure, JobFailedError)
    message = str(failure)
    assert "\n" not in message
    assert f"task {task.task_id}" in message
    assert "shard s3://bucket/part-0" in message
    assert "records [0, 4)" in message and "epoch 0" in message
    assert "failed 3 times" in message and "CUDA error: out of memory" in message
    assert dispatcher.get_task(1) == DONE and dispatcher.get_task(7) == DONE
    assert dispatcher.finished
    accounting = dispatcher.accounting()
    assert accounting.requeues["failed"] == 2
    assert accounting.records_trained_twice == 8


MODEL_ERROR = "model file /m/model.py, function feed: InvalidArgumentError: Feature: pixels is required"


def test_the_same_model_error_of_a_task_on_two_workers_fails_the_job_at_once() -> None:
    dispatcher = make({"a": 8}, max_task_retries=10)
    task = take(dispatcher, 1)
    assert dispatcher.report(task.task_id, 1, success=False, error=MODEL_ERROR, model_error=True)
    assert dispatcher.failure is None
    assert take(dispatcher, 1) == task  # the same worker again: an ordinary retry
    assert dispatcher.report(task.task_id, 1, success=False, error=MODEL_ERROR, model_error=True)
    assert dispatcher.failure is None
    assert take(dispatcher, 2) == task
    assert dispatcher.report(task.task_id, 2, success=False, error=MODEL_ERROR, model_error=True)
    failure = dispatcher.failure
    assert isinstance(failure, JobFailedError)
    message = str(failure)
    assert message.startswith(MODEL_ERROR) and "\n" not in message
    assert f"training task {task.task_id}" in message and "workers 1 and 2" in message, message
    assert dispatcher.finished and dispatcher.get_task(3) == DONE


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((MODEL_ERROR, True), (MODEL_ERROR + " (another record)", True)),  # another error
        ((MODEL_ERROR, True), ("StatusCode.UNAVAILABLE: PS 0 is gone", False)),  # infrastructure
        (("StatusCode.UNAVAILABLE: PS 0 is gone", False), ("StatusCode.UNAVAILABLE: PS 0 is gone", False)),
    ],
)
def test_other_failures_on_two_workers_are_retried_up_to_max_task_retries(
    first: tuple[str, bool], second: tuple[str, bool]
) -> None:
    dispatcher = make({"a": 8}, max_task_retries=3)
    task = take(dispatcher, 1)
    assert dispatcher.report(task.task_id, 1, success=False, error=first[0], model_error=first[1])
    assert take(dispatcher, 2) == task
    assert dispatcher.report(task.task_id, 2, success=False, error=second[0], model_error=second[1])
    assert dispatcher.failure is None
    assert take(dispatcher, 3) == task
    assert dispatcher.report(task.task_id, 3, success=True)
    assert dispatcher.failure is None


def test_a_model_error_seen_before_a_master_restart_still_counts() -> None:
    dispatcher = make({"a": 8}, max_task_retries=10)
    task = take(dispatcher, 1)
    assert dispatcher.report(task.task_id, 1, success=False, error=MODEL_ERROR, model_error=True)
    restored = TaskDispatcher.restore(json.loads(json.dumps(dispatcher.snapshot())), clock=FakeClock())
    assert take(restored, 2) == task
    assert restored.report(task.task_id, 2, success=False, error=MODEL_ERROR, model_error=True)
    assert restored.failure is not None and str(restored.failure).startswith(MODEL_ERROR)


def test_deaths_and_timeouts_are_not_retries() -> None:
    clock = FakeClock()
    dispatcher = make({"a": 4}, clock=clock, max_task_retries=2, initial_task_timeout=10)
    task = take(dispatcher, 1)
    assert dispatcher.report(task.task_id, 1, success=False, error="first")
    for _ in range(5):
        assert take(dispatcher, 2) == task
        assert dispatcher.recover_tasks(2) == [task]
        assert take(dispatcher, 3) == task
        clock.advance(11)
        assert dispatcher.reclaim_timed_out_tasks() == [(task, 3)]
    assert dispatcher.failure is None
    assert take(dispatcher, 4) == task
    assert dispatcher.report(task.task_id, 4, success=True)
    assert_no_record_lost(dispatcher, 1)
    assert dispatcher.accounting().requeues == {
        "worker_died": 5,
        "timeout": 5,
        "failed": 1,
        "master_restarted": 0,
    }


def test_dead_worker_tasks_go_back_to_the_front_in_order() -> None:
    dispatcher = make({"a": 24})
    held_by_1 = [take(dispatcher, 1), take(dispatcher, 1)]
    other = take(dispatcher, 2)
    assert dispatcher.recover_tasks(1) == held_by_1
    assert dispatcher.recover_tasks(1) == []
    assert dispatcher.recover_tasks(99) == []
    assert [take(dispatcher, 3), take(dispatcher, 3)] == held_by_1
    assert take(dispatcher, 3).start == 12
    assert dispatcher.report(other.task_id, 2, success=True)
    accounting = dispatcher.accounting()
    assert accounting.requeues["worker_died"] == 2
    assert accounting.records_trained_twice == 8
    assert not dispatcher.report(held_by_1[0].task_id, 1, success=True)  # the dead worker's late report


# ---------------------------------------------------------------- timeouts


def test_timeout_is_initial_until_three_successes_then_floor_or_factor_times_longest() -> None:
    clock = FakeClock()
    dispatcher = make(
        {"a": 4 * 200},
        clock=clock,
        task_timeout_floor=10.0,
        task_timeout_factor=2.0,
        initial_task_timeout=100.0,
    )

    def run(duration: float, worker: int = 0) -> None:
        task = take(dispatcher, worker)
        clock.advance(duration)
        assert dispatcher.report(task.task_id, worker, success=True)

    def held_for(seconds: float) -> list[tuple[Task, int]]:
        task = take(dispatcher, 9)
        clock.advance(seconds)
        reclaimed = dispatcher.reclaim_timed_out_tasks()
        if reclaimed:
            assert reclaimed == [(task, 9)]
        else:
            assert dispatcher.recover_tasks(9) == [task]
        return reclaimed

    assert not held_for(100.0)
    assert held_for(100.5)
    run(1.0)
    run(1.0)
    assert not held_for(100.0)  # two successes: still the initial timeout
    run(1.0)
    assert held_for(10.5)  # floor: max(10, 2 x 1)
    run(20.0)
    assert not held_for(40.0)  # factor: 2 x 20
    assert held_for(40.5)
    for _ in range(99):
        run(1.0)
    assert not held_for(40.0)  # the 20 s task is one of the last 100
    run(1.0)
    assert held_for(10.5)  # now it left the window


def test_timeouts_are_per_task_type_and_only_overdue_tasks_are_reclaimed() -> None:
    clock = FakeClock()
    dispatcher = make({"a": 40}, clock=clock, task_timeout_floor=5.0, initial_task_timeout=50.0)
    for _ in range(3):
        task = take(dispatcher)
        assert dispatcher.report(task.task_id, 0, success=True)
    dispatcher.create_evaluation_tasks({"e": 4}, model_version=1)
    evaluation = take(dispatcher, 1)
    old = take(dispatcher, 2)
    clock.advance(4.0)
    young = take(dispatcher, 3)
    clock.advance(2.0)
    assert dispatcher.reclaim_timed_out_tasks() == [(old, 2)]
    clock.advance(40.0)
    assert dispatcher.reclaim_timed_out_tasks() == [(young, 3)]
    clock.advance(5.0)
    assert dispatcher.reclaim_timed_out_tasks() == [(evaluation, 1)]
    assert dispatcher.accounting().requeues["timeout"] == 3


# ---------------------------------------------------------------- stale and duplicate reports


def test_stale_report_from_a_reclaimed_worker_is_ignored() -> None:
    clock = FakeClock()
    dispatcher = make({"a": 4}, clock=clock, initial_task_timeout=30.0)
    task = take(dispatcher, 1)
    clock.advance(31.0)
    assert dispatcher.reclaim_timed_out_tasks() == [(task, 1)]
    assert take(dispatcher, 2) == task
    assert not dispatcher.report(task.task_id, 1, success=True)  # too late: worker 2 holds it now
    assert not dispatcher.report(task.task_id, 1, success=False, error="late")
    assert dispatcher.accounting().records_done_per_epoch == {0: 0}
    assert dispatcher.get_task(1) == WAIT
    assert dispatcher.report(task.task_id, 2, success=True)
    assert_no_record_lost(dispatcher, 1)


def test_duplicate_and_unknown_reports_are_ignored() -> None:
    dispatcher = make({"a": 8})
    task = take(dispatcher, 1)
    assert dispatcher.report(task.task_id, 1, success=True)
    assert not dispatcher.report(task.task_id, 1, success=True)
    assert not dispatcher.report(task.task_id, 1, success=False)
    assert not dispatcher.report(12345, 1, success=True)
    assert not dispatcher.report(0, 1, success=True)
    accounting = dispatcher.accounting()
    assert accounting.records_done_per_epoch == {0: 4}
    assert accounting.tasks_done == 1
    assert dispatcher.progress() == (1, 2)


# ---------------------------------------------------------------- randomized simulation


SIM_SHARDS = {"s3://data/a": 53, "s3://data/b": 0, "s3://data/c": 17, "s3://data/d": 40}
SIM_EVAL_SHARDS = {"s3://eval/x": 23, "s3://eval/y": 9}
SIM_PREDICT_SHARDS = {"s3://predict/z": 31}
SIM_EPOCHS = 3
SIM_RECORDS_PER_TASK = 3


def tasks_in(shards: Mapping[str, int]) -> int:
    return sum(-(-size // SIM_RECORDS_PER_TASK) for size in shards.values())


class Simulation:
    """Workers that get, hold (up to two tasks), finish, fail, die and hang at random (seeded).

    The master side kills a worker whose task timed out and recovers the rest of its tasks; a killed
    worker's late reports ("zombies") must all be ignored.
    """

    def __init__(self, seed: int, num_workers: int = 5) -> None:
        self.rng = random.Random(seed)
        self.clock = FakeClock()
        self.completed_evaluations: list[int] = []
        self.dispatcher = TaskDispatcher(
            SIM_SHARDS,
            DispatcherConfig(
                records_per_task=SIM_RECORDS_PER_TASK,
                num_epochs=SIM_EPOCHS,
                shuffle=True,
                seed=seed,
                max_task_retries=10_000,
                task_timeout_floor=5.0,
                task_timeout_factor=3.0,
                initial_task_timeout=20.0,
            ),
            clock=self.clock,
            on_evaluation_complete=self.completed_evaluations.append,
        )
        self.workers: dict[int, list[Task]] = {}
        self.next_worker = 0
        for _ in range(num_workers):
            self._spawn()
        self.hung: set[int] = set()
        self.zombies: list[tuple[int, Task]] = []  # tasks of workers the master gave up on
        self.done: dict[tuple[TaskType, int], list[tuple[str, int, int]]] = defaultdict(list)
        self.expected_trained_twice = 0
        self.steps = 0

    def _spawn(self) -> None:
        self.workers[self.next_worker] = []
        self.next_worker += 1

    def _requeued(self, tasks: list[Task]) -> None:
        self.expected_trained_twice += sum(t.num_records for t in tasks if t.type is TaskType.TRAINING)

    def _kill(self, worker: int) -> None:
        held = self.workers.pop(worker)
        self.hung.discard(worker)
        recovered = self.dispatcher.recover_tasks(worker)
        assert {t.task_id for t in recovered} == {t.task_id for t in held}
        self._requeued(recovered)
        self.zombies.extend((worker, t) for t in held)
        self._spawn()

    def step(self) -> None:
        self.steps += 1
        rng, dispatcher = self.rng, self.dispatcher
        self.clock.advance(rng.uniform(0.0, 1.0))
        if self.steps == 40:
            dispatcher.create_evaluation_tasks(SIM_EVAL_SHARDS, model_version=1)
        if self.steps == 80:
            dispatcher.create_prediction_tasks(SIM_PREDICT_SHARDS)
        worker = rng.choice(sorted(self.workers))
        held = self.workers[worker]
        roll = rng.random()
        if roll < 0.02:
            self._kill(worker)
        elif roll < 0.06:
            reclaimed = dispatcher.reclaim_timed_out_tasks()
            self._requeued([t for t, _ in reclaimed])
            for task, stuck in reclaimed:
                self.workers[stuck].remove(task)
                self.zombies.append((stuck, task))
            for stuck in sorted({w for _, w in reclaimed}):
                self._kill(stuck)  # the master restarts a stuck worker
        elif worker in self.hung:
            pass  # a hung worker neither reports nor asks; only a timeout or its death ends that
        elif held and roll < 0.08:
            self.hung.add(worker)
        elif roll < 0.10 and self.zombies:
            zombie, task = self.zombies.pop(rng.randrange(len(self.zombies)))
            assert not dispatcher.report(task.task_id, zombie, success=rng.random() < 0.7)
        elif held and roll < 0.55:
            task = held.pop(rng.randrange(len(held)))
            success = rng.random() < 0.85
            assert dispatcher.report(task.task_id, worker, success=success, error="" if success else "boom")
            if success:
                self.done[task.type, task.epoch].append((task.shard, task.start, task.end))
            else:
                self._requeued([task])
        elif len(held) < 2:
            assignment = dispatcher.get_task(worker)
            assert assignment.kind != "done" or dispatcher.finished
            if assignment.task is not None:
                held.append(assignment.task)

    def run(self, max_steps: int = 50_000) -> None:
        while not self.dispatcher.finished:
            assert self.steps < max_steps, "simulation did not converge"
            self.step()

    def restart_master(self) -> int:
        """Replace the dispatcher by one restored from a JSON round trip of its snapshot."""
        snapshot = json.loads(json.dumps(self.dispatcher.snapshot()))
        self.clock.advance(30.0)  # the new master starts a while later
        self.dispatcher = TaskDispatcher.restore(
            snapshot, clock=self.clock, on_evaluation_complete=self.completed_evaluations.append
        )
        held = [task for tasks in self.workers.values() for task in tasks]
        self._requeued(held)
        for worker in list(self.workers):  # workers notice the new master and drop what they held
            self.workers[worker] = []
        return len(held)

    def check(self) -> None:
        dispatcher = self.dispatcher
        assert_no_record_lost(dispatcher, SIM_EPOCHS)
        for epoch in range(SIM_EPOCHS):
            assert_covered_once(self.done[TaskType.TRAINING, epoch], SIM_SHARDS)
        assert_covered_once(self.done[TaskType.EVALUATION, 0], SIM_EVAL_SHARDS)
        assert_covered_once(self.done[TaskType.PREDICTION, 0], SIM_PREDICT_SHARDS)
        assert self.completed_evaluations == [1]
        accounting = dispatcher.accounting()
        assert accounting.records_trained_twice == self.expected_trained_twice
        assert accounting.tasks_total == (
            SIM_EPOCHS * tasks_in(SIM_SHARDS) + tasks_in(SIM_EVAL_SHARDS) + tasks_in(SIM_PREDICT_SHARDS)
        )
        assert dispatcher.get_task(self.next_worker) == DONE


@pytest.mark.parametrize("seed", range(6))
def test_no_record_is_lost_or_trained_twice_under_random_deaths_failures_and_hangs(seed: int) -> None:
    simulation = Simulation(seed)
    simulation.run()
    simulation.check()
    requeues = simulation.dispatcher.accounting().requeues
    assert requeues["worker_died"] and requeues["timeout"] and requeues["failed"]
    assert simulation.dispatcher.accounting().records_trained_twice > 0


# ---------------------------------------------------------------- snapshot / restore


@pytest.mark.parametrize("seed", range(4))
def test_snapshot_json_round_trip_restore_continues_to_the_same_final_accounting(seed: int) -> None:
    uninterrupted = Simulation(seed)
    uninterrupted.run()
    uninterrupted.check()

    interrupted = Simulation(seed)
    for _ in range(120):
        interrupted.step()
    held = interrupted.restart_master()
    assert held > 0
    assert interrupted.dispatcher.accounting().requeues["master_restarted"] == held
    interrupted.run()
    interrupted.check()

    final, expected = interrupted.dispatcher.accounting(), uninterrupted.dispatcher.accounting()
    assert final.records_done_per_epoch == expected.records_done_per_epoch
    assert (final.records_per_epoch, final.tasks_done, final.tasks_total) == (
        expected.records_per_epoch,
        expected.tasks_done,
        expected.tasks_total,
    )
    assert final.requeues["master_restarted"] == held


def test_restore_puts_held_tasks_back_at_the_front_and_keeps_everything_else() -> None:
    clock = FakeClock()
    dispatcher = make({"a": 40}, clock=clock, num_epochs=2, shuffle=True, seed=3, max_task_retries=5)
    finished = take(dispatcher, 1)
    assert dispatcher.report(finished.task_id, 1, success=True)
    failed = take(dispatcher, 1)
    assert dispatcher.report(failed.task_id, 1, success=False, error="x")
    first_held, second_held = take(dispatcher, 2), take(dispatcher, 3)
    assert first_held == failed
    dispatcher.create_evaluation_tasks({"e": 4}, model_version=9)
    clock.advance(7.0)

    snapshot = json.loads(json.dumps(dispatcher.snapshot()))
    assert [entry["age"] for entry in held_tasks(snapshot)] == [7.0, 7.0]
    restored = TaskDispatcher.restore(snapshot, clock=FakeClock())
    assert restored.evaluation_pending(9)
    assert take(restored, 5).type is TaskType.EVALUATION
    assert [take(restored, 5), take(restored, 5)] == [first_held, second_held]
    assert not restored.report(second_held.task_id, 3, success=True)  # the old master's assignment
    accounting = restored.accounting()
    assert accounting.requeues == {"worker_died": 0, "timeout": 0, "failed": 1, "master_restarted": 2}
    assert accounting.records_done_per_epoch == {0: 4, 1: 0}
    assert restored.snapshot()["failures"] == {str(failed.task_id): 1}
    assert restored.progress() == (1, 20)


def test_restore_keeps_the_tasks_of_surviving_workers_held_by_them() -> None:
    clock = FakeClock()
    dispatcher = make({"a": 40}, clock=clock, num_epochs=1)
    survivor_task, lost_task = take(dispatcher, 1), take(dispatcher, 2)
    clock.advance(5.0)

    snapshot = json.loads(json.dumps(dispatcher.snapshot()))
    restored = TaskDispatcher.restore(snapshot, clock=clock, live_workers={1})
    assert restored.accounting().requeues["master_restarted"] == 1
    assert restored.accounting().records_trained_twice == lost_task.num_records
    assert [(e["worker_id"], e["age"]) for e in held_tasks(restored.snapshot())] == [(1, 5.0)]
    assert take(restored, 3) == lost_task  # only the lost worker's task went back to the front
    assert restored.report(survivor_task.task_id, 1, success=True)  # the survivor's report counts
    assert not restored.report(lost_task.task_id, 2, success=True)  # the lost worker's does not
    assert restored.accounting().records_done_per_epoch == {0: survivor_task.num_records}


def test_snapshot_of_a_restored_idle_dispatcher_is_identical() -> None:
    dispatcher = make({"a": 30, "b": 7}, num_epochs=3, shuffle=True)
    for _ in range(4):
        task = take(dispatcher)
        assert dispatcher.report(task.task_id, 0, success=True)
    snapshot = json.loads(json.dumps(dispatcher.snapshot()))
    assert TaskDispatcher.restore(snapshot, clock=FakeClock()).snapshot() == snapshot


def test_restore_of_a_failed_job_stays_failed() -> None:
    dispatcher = make({"a": 4}, max_task_retries=1)
    task = take(dispatcher)
    dispatcher.report(task.task_id, 0, success=False, error="bad record")
    restored = TaskDispatcher.restore(json.loads(json.dumps(dispatcher.snapshot())), clock=FakeClock())
    assert str(restored.failure) == str(dispatcher.failure)
    assert restored.get_task(0) == DONE


@pytest.mark.parametrize("snapshot", [{}, {"format": 99}, {"format": 1, "config": {}}, []])
def test_unreadable_snapshot_is_a_data_format_error(snapshot: object) -> None:
    with pytest.raises(DataFormatError, match="snapshot"):
        TaskDispatcher.restore(snapshot, clock=FakeClock())  # type: ignore[arg-type]


# ---------------------------------------------------------------- concurrency


def test_eight_threads_hammering_get_and_report_end_consistent() -> None:
    shards = {f"shard-{i}": 997 for i in range(10)}
    dispatcher = TaskDispatcher(
        shards, DispatcherConfig(records_per_task=10, num_epochs=2, max_task_retries=1000)
    )
    done: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(worker_id: int) -> None:
        rng = random.Random(worker_id)
        local: list[Task] = []
        try:
            start.wait()
            while (assignment := dispatcher.get_task(worker_id)).kind != "done":
                if assignment.task is None:
                    time.sleep(0)
                    continue
                task = assignment.task
                success = rng.random() < 0.9
                assert dispatcher.report(task.task_id, worker_id, success=success, error="flaky")
                if success:
                    local.append(task)
                if worker_id == 0 and rng.random() < 0.01:
                    dispatcher.accounting()
                    dispatcher.reclaim_timed_out_tasks()
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)
        for task in local:
            done[task.epoch].append((task.shard, task.start, task.end))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    assert not any(thread.is_alive() for thread in threads)
    assert_no_record_lost(dispatcher, 2)
    for epoch in range(2):
        assert_covered_once(done[epoch], shards)
    assert dispatcher.progress() == (2000, 2000)


def test_snapshot_with_an_invalid_config_is_a_data_format_error() -> None:
    snapshot = make({"a": 4}).snapshot()
    snapshot["config"]["records_per_task"] = 0
    with pytest.raises(DataFormatError, match="snapshot is corrupt"):
        TaskDispatcher.restore(snapshot, clock=FakeClock())
