"""Dynamic sharding: the master's task bookkeeping.

The dataset is a set of *shards* (a shard key and its number of records). The dispatcher cuts every
shard into record ranges of ``records_per_task`` records (the last range of a shard may be shorter)
and hands them out as :class:`Task` objects to whichever worker asks next. A task is in exactly one
of three places: a *todo* queue (one per :class:`TaskType`), *doing* (held by one worker since a
given time), or done. Tasks that a worker could not finish go back to the **front** of their todo
queue, so every record range of every epoch is trained exactly once in a successful task, whatever
happens to the workers; :meth:`TaskDispatcher.accounting` proves it.

Everything here is pure bookkeeping: no RPC, no I/O, no TensorFlow. All public methods are
thread-safe (one lock). ``get_task`` and ``report`` cost O(1) amortised: the ``get_task`` that
starts an epoch cuts (and, with ``shuffle``, shuffles) that epoch's ranges, O(tasks per epoch) but
cheap, since a range becomes a :class:`Task` only when it is handed out. ``recover_tasks`` and
``reclaim_timed_out_tasks`` cost O(1 + tasks requeued); ``snapshot`` O(tasks queued). Time comes
from an injectable ``clock`` so timeouts can be tested without sleeping.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from edl_argo.errors import ConfigError, DataFormatError, JobFailedError
from edl_argo.log import get_logger

log = get_logger(__name__)

SNAPSHOT_FORMAT = 1
"""Version of the :meth:`TaskDispatcher.snapshot` layout; bumped on incompatible changes."""

DURATION_WINDOW = 100
"""Number of most recent successful tasks of a type whose durations set that type's timeout."""

MIN_DURATIONS_FOR_TIMEOUT = 3
"""Until this many tasks of a type succeeded, ``initial_task_timeout`` applies to that type."""

MAX_UNSAVED_TASK_IDS = 1_000_000
"""How far beyond its next task id :meth:`TaskDispatcher.skip_task_ids` takes a worker's word for a task."""

RequeueReason = Literal["worker_died", "timeout", "failed", "master_restarted"]
REQUEUE_REASONS: tuple[RequeueReason, ...] = ("worker_died", "timeout", "failed", "master_restarted")


class TaskType(enum.Enum):
    """What a worker does with a task's records."""

    TRAINING = "training"
    EVALUATION = "evaluation"
    PREDICTION = "prediction"


# Dispatch priority: evaluation first (it gates the master's model-version decisions), then
# prediction, then training.
_PRIORITY: tuple[TaskType, ...] = (TaskType.EVALUATION, TaskType.PREDICTION, TaskType.TRAINING)


@dataclass(frozen=True, slots=True)
class Task:
    """Records ``[start, end)`` of shard ``shard``, to be processed as ``type``.

    ``task_id`` is unique over the whole job and survives requeues: a task that is handed out again
    after a failure keeps its id. ``epoch`` is 0-based (0 for non-training tasks); ``model_version``
    is the model version being evaluated for evaluation tasks and -1 otherwise.
    """

    task_id: int
    type: TaskType
    shard: str
    start: int
    end: int
    epoch: int = 0
    model_version: int = -1

    @property
    def num_records(self) -> int:
        return self.end - self.start

    def describe(self) -> str:
        """A short human description naming the task, e.g. for error messages."""
        text = (
            f"{self.type.value} task {self.task_id} (shard {self.shard}, records [{self.start}, {self.end})"
        )
        if self.type is TaskType.TRAINING:
            text += f", epoch {self.epoch}"
        elif self.type is TaskType.EVALUATION:
            text += f", model version {self.model_version}"
        return text + ")"

    def to_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "type": self.type.value,
            "shard": self.shard,
            "start": self.start,
            "end": self.end,
            "epoch": self.epoch,
            "model_version": self.model_version,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Task:
        return cls(
            task_id=int(data["task_id"]),
            type=TaskType(data["type"]),
            shard=str(data["shard"]),
            start=int(data["start"]),
            end=int(data["end"]),
            epoch=int(data["epoch"]),
            model_version=int(data["model_version"]),
        )


@dataclass(frozen=True, slots=True)
class TaskAssignment:
    """The answer to :meth:`TaskDispatcher.get_task`.

    * ``"task"``: process ``task`` and report it.
    * ``"wait"``: nothing to do right now, but the job is not over (tasks are still held by other
      workers and may come back, or an evaluation round is running); ask again later.
    * ``"done"``: the job is over (completed, or failed: see :attr:`TaskDispatcher.failure`); exit.

    ``task`` is set if and only if ``kind == "task"``.
    """

    kind: Literal["task", "wait", "done"]
    task: Task | None = None

    def __post_init__(self) -> None:
        if (self.kind == "task") != (self.task is not None):
            raise ValueError(f"TaskAssignment kind={self.kind!r} with task={self.task!r}")


WAIT = TaskAssignment("wait")
DONE = TaskAssignment("done")


@dataclass
class DispatcherConfig:
    """How tasks are cut, ordered, retried and timed out.

    ``records_per_task`` is minibatch_size x num_minibatches_per_task. A task fails the job after
    ``max_task_retries`` failed reports (a worker dying or timing out does not count). The timeout of a
    task type is ``max(task_timeout_floor, task_timeout_factor x longest of the last 100 successful
    durations of that type)``, or ``initial_task_timeout`` until 3 tasks of that type succeeded.
    """

    records_per_task: int
    num_epochs: int
    shuffle: bool = False
    seed: int = 0
    max_task_retries: int = 3
    task_timeout_floor: float = 60.0
    task_timeout_factor: float = 5.0
    initial_task_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.records_per_task < 1:
            raise ConfigError(f"records_per_task must be at least 1, got {self.records_per_task}")
        if self.num_epochs < 0:
            raise ConfigError(f"num_epochs must be 0 or more, got {self.num_epochs}")
        if self.max_task_retries < 1:
            raise ConfigError(f"max_task_retries must be at least 1, got {self.max_task_retries}")
        for name in ("task_timeout_floor", "task_timeout_factor", "initial_task_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class Accounting:
    """A consistent snapshot of the job's record accounting.

    No record was lost or trained twice in successful tasks iff, once :attr:`TaskDispatcher.finished`
    (and not failed), every value of ``records_done_per_epoch`` equals ``records_per_epoch``.

    * ``records_per_epoch``: records in the training dataset (one epoch).
    * ``records_done_per_epoch``: epoch (0-based; every epoch of the job present, or only those begun:
      :meth:`TaskDispatcher.accounting`) -> records of its
      training tasks that completed successfully. A task counts once, whatever its retries.
    * ``records_trained_twice``: sum of ``num_records`` over every requeue of a training task that
      had been handed out (its records were possibly partly trained, and will be trained again).
    * ``requeues``: number of requeues (all task types) per reason, every reason of
      :data:`REQUEUE_REASONS` present.
    * ``tasks_done`` / ``tasks_total``: tasks of all types completed / known so far (all training
      tasks of all epochs plus the evaluation and prediction tasks created so far).
    """

    records_per_epoch: int
    records_done_per_epoch: dict[int, int]
    records_trained_twice: int
    requeues: dict[str, int]
    tasks_done: int
    tasks_total: int


@dataclass(frozen=True)
class TaskCounts:
    """The tasks of one type (:meth:`TaskDispatcher.task_counts`).

    * ``created``: known so far (training: every task of every epoch, from the start).
    * ``queued``: waiting to be handed out now (training: of the epochs started so far).
    * ``running``: held by a worker.
    * ``done``: completed successfully (each task once, whatever its retries).
    * ``failed``: failed reports (a task failing twice counts twice; a worker dying or timing out is no
      failed report but a requeue, :attr:`Accounting.requeues`).
    """

    created: int
    queued: int
    running: int
    done: int
    failed: int


@dataclass(slots=True)
class _Running:
    task: Task
    worker_id: int
    started: float
    saved: dict[str, Any] | None = None  # its snapshot entry, made once (it never changes)

    def to_json(self) -> dict[str, Any]:
        if self.saved is None:
            self.saved = {"task": self.task.to_json(), "worker_id": self.worker_id, "started": self.started}
        return self.saved


_Range = tuple[str, int, int, int, int]
"""A task not handed out yet: ``(shard, start, end, epoch, model_version)``; it gets its id when it is."""


def _check_size(shard: str, size: object) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ConfigError(f"shard {shard} has an invalid number of records {size!r}; expected an int >= 0")
    return size


def _count_tasks(shards: Mapping[str, int], records_per_task: int) -> int:
    return sum(-(-_check_size(shard, size) // records_per_task) for shard, size in shards.items())


def _cut(shards: Mapping[str, int], records_per_task: int, epoch: int, model_version: int) -> list[_Range]:
    """Ranges of ``records_per_task`` records covering every shard in order (the last range of a shard
    may be shorter; an empty shard gives none)."""
    ranges: list[_Range] = []
    for shard, size in shards.items():
        first = len(ranges)
        starts = range(0, _check_size(shard, size), records_per_task)
        ranges.extend((shard, start, start + records_per_task, epoch, model_version) for start in starts)
        if len(ranges) > first:
            ranges[-1] = (shard, starts[-1], size, epoch, model_version)
    return ranges


def held_tasks(snapshot: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The held tasks of a :meth:`TaskDispatcher.snapshot`, each ``{"task", "worker_id", "age"}`` (seconds
    held when it was taken), from a snapshot of this version or of one before ``held`` existed."""
    if "held" not in snapshot:
        return list(snapshot["doing"])
    now = float(snapshot["clock"])
    return [
        {"task": entry["task"], "worker_id": entry["worker_id"], "age": now - float(entry["started"])}
        for entry in snapshot["held"].values()
    ]


class TaskDispatcher:
    """Hands out record-range tasks to workers and keeps every record of every epoch accounted for.

    Training tasks of epoch ``e`` are created when the training todo queue drains and fewer than
    ``num_epochs`` epochs were created (in shard order, or shuffled with an RNG seeded by
    ``(seed, e)`` when ``config.shuffle``). A task gets its id when it is first handed out: ids
    start at 1, follow dispatch order and are unique over the job (skipping those of
    :meth:`skip_task_ids`); a requeued task keeps its id.

    Evaluation rounds: ``on_evaluation_complete(model_version)`` is called, outside the lock, by the
    thread whose :meth:`report` completes the last outstanding evaluation task of that model version
    (or by :meth:`create_evaluation_tasks` itself if the round has no records). It must not block for
    long; it may call back into the dispatcher. :meth:`evaluation_pending` answers the same question by
    polling.

    ``clock`` must never go backwards (:func:`time.monotonic` by default).
    """

    def __init__(
        self,
        training_shards: Mapping[str, int],
        config: DispatcherConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_evaluation_complete: Callable[[int], None] | None = None,
    ) -> None:
        self._config = dataclasses.replace(config)
        self._shards = dict(training_shards)
        self._clock = clock
        self._on_evaluation_complete = on_evaluation_complete
        self._lock = threading.Lock()

        self._tasks_per_epoch = _count_tasks(self._shards, config.records_per_task)
        self._records_per_epoch = sum(self._shards.values())

        self._epochs_created = 0
        self._next_task_id = 1
        # The todo queue of a type is its requeued tasks (front) followed by its fresh ranges. Fresh
        # ranges become Task objects only when handed out, so creating an epoch stays cheap.
        self._requeued: dict[TaskType, deque[Task]] = {t: deque() for t in TaskType}
        self._fresh: dict[TaskType, deque[_Range]] = {t: deque() for t in TaskType}
        # task id -> running record, plus per-type views in start order (the clock never goes back),
        # so timed-out tasks are found from the front, and per-worker views for recover_tasks.
        self._doing: dict[int, _Running] = {}
        self._doing_by_type: dict[TaskType, dict[int, _Running]] = {t: {} for t in TaskType}
        self._held: dict[int, dict[int, None]] = {}
        self._saved_doing: dict[
            str, dict[str, Any]
        ] = {}  # what snapshot() saves of _doing, kept as it changes
        self._failures: dict[int, int] = {}
        # Task id -> (worker, error) of the last model error reported for it (see report()).
        self._model_errors: dict[int, tuple[int, str]] = {}
        self._durations: dict[TaskType, deque[float]] = {t: deque(maxlen=DURATION_WINDOW) for t in TaskType}
        self._tasks_created: dict[TaskType, int] = {t: 0 for t in TaskType}
        self._tasks_done: dict[TaskType, int] = {t: 0 for t in TaskType}
        self._tasks_failed: dict[TaskType, int] = {t: 0 for t in TaskType}
        self._tasks_created[TaskType.TRAINING] = config.num_epochs * self._tasks_per_epoch
        # Records done per epoch started (an epoch not started yet has none: not kept, so that the state
        # saved after every report does not grow with num_epochs).
        self._records_done: dict[int, int] = {}
        self._records_trained_twice = 0
        self._requeues: dict[str, int] = {reason: 0 for reason in REQUEUE_REASONS}
        self._evaluations_pending: dict[int, int] = {}
        self._failure: JobFailedError | None = None
        self._training_held = False

    # ------------------------------------------------------------------ dispatching

    def hold_training(self, held: bool) -> None:
        """While ``held``, :meth:`get_task` hands out no training task (WAIT instead; evaluation and
        prediction tasks still go out). Tasks already handed out are unaffected. Not saved: the master
        decides it afresh from its pods (:mod:`edl_argo.master.worker_scaler`)."""
        with self._lock:
            self._training_held = held

    def get_task(self, worker_id: int) -> TaskAssignment:
        """The next task for ``worker_id`` (evaluation, then prediction, then training), WAIT or DONE.

        Returns DONE once the job completed or failed, WAIT while nothing is queued but tasks are still
        held by workers (they may be requeued).
        """
        with self._lock:
            if self._failure is None:
                while (
                    not self._has_todo(TaskType.TRAINING) and self._epochs_created < self._config.num_epochs
                ):
                    self._create_epoch()
                for task_type in _PRIORITY:
                    if task_type is TaskType.TRAINING and self._training_held:
                        continue
                    task = self._pop_todo(task_type)
                    if task is not None:
                        self._start(task, worker_id, self._clock())
                        log.debug("task_assigned", task=task.task_id, worker=worker_id, type=task_type.value)
                        return TaskAssignment("task", task)
            return DONE if self._finished_locked() else WAIT

    def report(
        self, task_id: int, worker_id: int, success: bool, error: str = "", *, model_error: bool = False
    ) -> bool:
        """Record the outcome of a task; return whether the report was accepted.

        Success marks the task done (its records count once). Failure requeues it at the front of its
        queue; its ``max_task_retries``-th failure fails the job instead (see :attr:`failure`). A failure
        with ``model_error`` (``error`` was raised in the model file's code, see
        :mod:`edl_argo.model.user_code`) that another worker already reported for this task, with the same
        ``error``, fails the job at once with that error: the model fails the same way wherever it runs.
        A report for a task that ``worker_id`` does not currently hold (unknown id, already done, or
        reclaimed from this worker and possibly handed to another) changes nothing and returns False.
        """
        completed_version: int | None = None
        with self._lock:
            running = self._doing.get(task_id)
            if running is None or running.worker_id != worker_id:
                self._log_ignored(task_id, worker_id, running)
                return False
            task = running.task
            if success:
                self._stop(task_id)
                self._durations[task.type].append(self._clock() - running.started)
                self._tasks_done[task.type] += 1
                self._failures.pop(task_id, None)
                self._model_errors.pop(task_id, None)
                if task.type is TaskType.TRAINING:
                    self._records_done[task.epoch] = self._records_done.get(task.epoch, 0) + task.num_records
                elif task.type is TaskType.EVALUATION:
                    completed_version = self._evaluation_task_done(task.model_version)
                log.debug("task_done", task=task_id, worker=worker_id, records=task.num_records)
            else:
                failures = self._failures.get(task_id, 0) + 1
                self._failures[task_id] = failures
                self._tasks_failed[task.type] += 1
                if model_error and self._same_model_error(task, worker_id, error):
                    self._stop(task_id)
                elif failures < self._config.max_task_retries:
                    log.warning("task_failed", task=task_id, worker=worker_id, failures=failures, error=error)
                    self._requeue([running], "failed")
                else:
                    self._stop(task_id)
                    self._fail(task, failures, error)
        if completed_version is not None:
            self._notify_evaluation_complete(completed_version)
        return True

    def fail_task(self, task_id: int, worker_id: int, error: str) -> bool:
        """A fatal failure of a task that ``worker_id`` holds, one that no retry can cure (the training
        loss became NaN): the job fails at once, with ``error`` as its message (see :attr:`failure`). A
        report for a task the worker does not hold changes nothing and returns False, as for :meth:`report`.
        """
        with self._lock:
            running = self._doing.get(task_id)
            if running is None or running.worker_id != worker_id:
                self._log_ignored(task_id, worker_id, running)
                return False
            self._stop(task_id)
            self._tasks_failed[running.task.type] += 1
            if self._failure is None:
                self._failure = JobFailedError(error or f"{running.task.describe()} failed")
                log.error("job_failed", task=task_id, shard=running.task.shard, fatal=True, error=error)
        return True

    def held_task(self, task_id: int, worker_id: int) -> Task | None:
        """Task ``task_id`` if ``worker_id`` holds it now, else None (unknown, done, or someone else's)."""
        with self._lock:
            running = self._doing.get(task_id)
            return running.task if running is not None and running.worker_id == worker_id else None

    def oldest_held_task(self, worker_id: int, excluding: Collection[int] = ()) -> Task | None:
        """The task ``worker_id`` got first among those it holds now and that are not in ``excluding``
        (those it says it holds), or None if there is none: a task whose reply the worker never got
        (:func:`edl_argo.master.failover.lost_reply`)."""
        with self._lock:
            held = [task_id for task_id in self._held.get(worker_id, {}) if task_id not in excluding]
            return self._doing[held[0]].task if held else None

    def skip_task_ids(self, task_ids: Collection[int]) -> list[int]:
        """Of ``task_ids`` (tasks a worker holds), those this dispatcher never handed out: the tasks it
        hands out from now on get larger ids, so that none is given one of those (a master that died before
        saving handed them out; see :func:`edl_argo.master.failover.skip_unsaved_task_ids`). Ids more than
        :data:`MAX_UNSAVED_TASK_IDS` ahead are not skipped. Returns the ids skipped."""
        with self._lock:
            first = self._next_task_id
            unknown = sorted(i for i in task_ids if first <= i < first + MAX_UNSAVED_TASK_IDS)
            if unknown:
                self._next_task_id = unknown[-1] + 1
            return unknown

    def recover_tasks(self, worker_id: int) -> list[Task]:
        """``worker_id`` died: requeue every task it held at the front of its queue, in the order it got
        them (this is not a retry of the task). Returns those tasks; unknown workers hold none."""
        with self._lock:
            held = self._held.get(worker_id, {})
            running = [self._doing[task_id] for task_id in held]
            self._requeue(running, "worker_died")
        return [r.task for r in running]

    def reclaim_timed_out_tasks(self) -> list[tuple[Task, int]]:
        """Requeue, at the front of their queues, the tasks held longer than their type's timeout (this
        is not a retry of the task). Returns ``(task, worker_id)`` pairs, so the caller can treat those
        workers as stuck. Cost: O(1 + tasks reclaimed) -- call it periodically."""
        reclaimed: list[_Running] = []
        with self._lock:
            now = self._clock()
            for task_type, doing in self._doing_by_type.items():
                timeout = self._timeout(task_type)
                expired = []
                for running in doing.values():  # oldest first
                    if now - running.started <= timeout:
                        break
                    expired.append(running)
                self._requeue(expired, "timeout")
                reclaimed.extend(expired)
        return [(r.task, r.worker_id) for r in reclaimed]

    def create_evaluation_tasks(self, shards: Mapping[str, int], model_version: int) -> int:
        """Queue an evaluation round of ``model_version`` over ``shards``; return the number of tasks.

        Evaluation tasks are handed out before any other task. When every task of the round completed,
        ``on_evaluation_complete(model_version)`` is called (immediately if the round is empty).
        Creating a second round for a version already pending extends that round.
        """
        with self._lock:
            created = self._add_tasks(TaskType.EVALUATION, shards, 0, model_version)
            if created:
                self._evaluations_pending[model_version] = (
                    self._evaluations_pending.get(model_version, 0) + created
                )
        log.info("evaluation_created", model_version=model_version, tasks=created)
        if not created:
            self._notify_evaluation_complete(model_version)
        return created

    def create_prediction_tasks(self, shards: Mapping[str, int]) -> int:
        """Queue prediction tasks over ``shards`` (handed out after evaluation, before training tasks);
        return the number of tasks created."""
        with self._lock:
            created = self._add_tasks(TaskType.PREDICTION, shards, 0, -1)
        log.info("prediction_created", tasks=created)
        return created

    # ------------------------------------------------------------------ state

    def evaluation_pending(self, model_version: int) -> bool:
        """Whether an evaluation round of ``model_version`` has tasks not yet completed."""
        with self._lock:
            return model_version in self._evaluations_pending

    @property
    def finished(self) -> bool:
        """True iff :meth:`get_task` returns DONE: every task completed, or the job failed."""
        with self._lock:
            return self._finished_locked()

    @property
    def failure(self) -> JobFailedError | None:
        """Why the job failed (a task exhausted its retries), or None."""
        with self._lock:
            return self._failure

    def progress(self) -> tuple[int, int]:
        """``(training tasks done, training tasks of all epochs)``, for an ``N/M`` display."""
        with self._lock:
            return self._tasks_done[TaskType.TRAINING], self._tasks_created[TaskType.TRAINING]

    def task_counts(self) -> dict[TaskType, TaskCounts]:
        """A consistent count of the tasks of each type (see :class:`TaskCounts`); O(task types)."""
        with self._lock:
            return {
                t: TaskCounts(
                    created=self._tasks_created[t],
                    queued=len(self._requeued[t]) + len(self._fresh[t]),
                    running=len(self._doing_by_type[t]),
                    done=self._tasks_done[t],
                    failed=self._tasks_failed[t],
                )
                for t in TaskType
            }

    def accounting(self, *, epochs_begun_only: bool = False) -> Accounting:
        """A consistent copy of the record accounting (see :class:`Accounting`).

        ``epochs_begun_only``: ``records_done_per_epoch`` names only the epochs begun so far (the others have
        none done), so that what reads it on every tick of the master costs O(epochs begun), not
        O(``num_epochs``), which a job repeating a small dataset sets high.
        """
        with self._lock:
            if epochs_begun_only:
                records_done = dict(self._records_done)
            else:
                records_done = {
                    epoch: self._records_done.get(epoch, 0) for epoch in range(self._config.num_epochs)
                }
            return Accounting(
                records_per_epoch=self._records_per_epoch,
                records_done_per_epoch=records_done,
                records_trained_twice=self._records_trained_twice,
                requeues=dict(self._requeues),
                tasks_done=sum(self._tasks_done.values()),
                tasks_total=sum(self._tasks_created.values()),
            )

    def snapshot(self) -> dict[str, Any]:
        """The whole state as JSON-serialisable data; :meth:`restore` is its inverse.

        Its size follows the tasks held, requeued and failing, not the tasks of an epoch or of the job, and
        what changes between two snapshots is what changed in between (a state saved after every change
        saves only that: :mod:`edl_argo.master.state_log`): the training tasks not handed out yet are saved
        as how many of the current epoch's are left (``fresh_training``; the epoch's order is cut again from
        the shards and the seed on restore; the shard table is shared, not copied: it never changes), held
        tasks (``held``, by id) with the clock reading of their
        start and the snapshot's own (``clock``), so that their age means the same to a master with another
        clock (:func:`held_tasks` reads them back as ages).
        """
        with self._lock:
            return {
                "format": SNAPSHOT_FORMAT,
                "config": dataclasses.asdict(self._config),
                "training_shards": self._shards,
                "epochs_created": self._epochs_created,
                "next_task_id": self._next_task_id,
                "requeued": {t.value: [task.to_json() for task in q] for t, q in self._requeued.items()},
                "fresh": {
                    t.value: [list(r) for r in q]
                    for t, q in self._fresh.items()
                    if t is not TaskType.TRAINING
                },
                "fresh_training": len(self._fresh[TaskType.TRAINING]),
                "clock": self._clock(),
                "held": dict(self._saved_doing),
                "failures": {str(task_id): n for task_id, n in self._failures.items()},
                "model_errors": {str(task_id): list(seen) for task_id, seen in self._model_errors.items()},
                "durations": {t.value: self._saved_durations(t) for t in TaskType},
                "tasks_created": {t.value: n for t, n in self._tasks_created.items()},
                "tasks_done": {t.value: n for t, n in self._tasks_done.items()},
                "tasks_failed": {t.value: n for t, n in self._tasks_failed.items()},
                "records_done_per_epoch": {str(epoch): n for epoch, n in self._records_done.items()},
                "records_trained_twice": self._records_trained_twice,
                "requeues": dict(self._requeues),
                "evaluations_pending": {str(v): n for v, n in self._evaluations_pending.items()},
                "failure": None if self._failure is None else str(self._failure),
            }

    @classmethod
    def restore(
        cls,
        snapshot: Mapping[str, Any],
        *,
        clock: Callable[[], float] = time.monotonic,
        on_evaluation_complete: Callable[[int], None] | None = None,
        live_workers: Collection[int] = (),
    ) -> TaskDispatcher:
        """Rebuild a dispatcher from :meth:`snapshot` data (e.g. after a master restart).

        ``live_workers``: the workers that outlived the old master (the new master re-adopted them).
        Tasks they held stay held by them, with their age, so their reports are accepted. Every other
        held task goes back to the front of its queue (requeue reason ``master_restarted``): its
        worker's report, if it ever comes, is ignored. Raises :class:`DataFormatError` if ``snapshot``
        is not a snapshot this version can read.
        """
        if not isinstance(snapshot, Mapping) or snapshot.get("format") != SNAPSHOT_FORMAT:
            found = snapshot.get("format") if isinstance(snapshot, Mapping) else type(snapshot).__name__
            raise DataFormatError(
                f"task dispatcher snapshot has format {found!r}, expected {SNAPSHOT_FORMAT};"
                " it was written by another edl-argo version: restart the job from scratch"
            )
        try:
            dispatcher = cls(
                snapshot["training_shards"],
                DispatcherConfig(**snapshot["config"]),
                clock=clock,
                on_evaluation_complete=on_evaluation_complete,
            )
            dispatcher._load(snapshot, frozenset(live_workers))
        except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as exc:
            raise DataFormatError(
                f"task dispatcher snapshot is corrupt ({type(exc).__name__}: {exc})"
            ) from exc
        return dispatcher

    # ------------------------------------------------------------------ internals (lock held)

    def _load(self, snapshot: Mapping[str, Any], live_workers: frozenset[int]) -> None:
        with self._lock:
            now = self._clock()
            self._epochs_created = int(snapshot["epochs_created"])
            self._next_task_id = int(snapshot["next_task_id"])
            for t in TaskType:
                self._requeued[t].extend(Task.from_json(data) for data in snapshot["requeued"][t.value])
                if t is TaskType.TRAINING and "fresh_training" in snapshot:
                    left = int(snapshot["fresh_training"])
                    ranges = self._epoch_ranges(self._epochs_created - 1) if left else []
                    self._fresh[t].extend(ranges[len(ranges) - left :])
                else:
                    self._fresh[t].extend(
                        (str(shard), int(start), int(end), int(epoch), int(version))
                        for shard, start, end, epoch, version in snapshot["fresh"][t.value]
                    )
                durations = snapshot["durations"][t.value]
                if isinstance(durations, Mapping):  # by success number (see snapshot)
                    durations = [durations[k] for k in sorted(durations, key=int)]
                self._durations[t].extend(float(d) for d in durations)
                self._tasks_created[t] = int(snapshot["tasks_created"][t.value])
                self._tasks_done[t] = int(snapshot["tasks_done"][t.value])
                self._tasks_failed[t] = int(snapshot.get("tasks_failed", {}).get(t.value, 0))  # newer than 1
            self._failures = {int(k): int(n) for k, n in snapshot["failures"].items()}
            self._model_errors = {
                int(k): (int(worker), str(error))
                for k, (worker, error) in snapshot.get("model_errors", {}).items()
            }
            self._records_done = {int(k): int(n) for k, n in snapshot["records_done_per_epoch"].items()}
            self._records_trained_twice = int(snapshot["records_trained_twice"])
            self._requeues.update({str(k): int(n) for k, n in snapshot["requeues"].items()})
            self._evaluations_pending = {int(k): int(n) for k, n in snapshot["evaluations_pending"].items()}
            if snapshot["failure"] is not None:
                self._failure = JobFailedError(snapshot["failure"])
            doing = sorted(held_tasks(snapshot), key=lambda entry: -float(entry["age"]))  # oldest first
            for entry in doing:
                self._start(Task.from_json(entry["task"]), int(entry["worker_id"]), now - float(entry["age"]))
            orphans = [r for r in self._doing.values() if r.worker_id not in live_workers]
            self._requeue(orphans, "master_restarted")

    def _create_epoch(self) -> None:
        epoch = self._epochs_created
        created = self._add_tasks(TaskType.TRAINING, self._shards, epoch, -1)
        self._epochs_created += 1
        self._records_done.setdefault(epoch, 0)
        log.info("epoch_started", epoch=epoch, tasks=created, records=self._records_per_epoch)

    def _saved_durations(self, task_type: TaskType) -> dict[str, float]:
        """The recent durations of ``task_type`` by the number of the success that took them (milliseconds
        kept), so that a snapshot after one more success differs from the one before by one added and one
        dropped."""
        durations = self._durations[task_type]
        first = self._tasks_done[task_type] - len(durations)
        return {str(first + i): round(d, 3) for i, d in enumerate(durations)}

    def _epoch_ranges(self, epoch: int) -> list[_Range]:
        """The training ranges of ``epoch``, in the order they are handed out (the same every time)."""
        ranges = _cut(self._shards, self._config.records_per_task, epoch, -1)
        if self._config.shuffle:
            random.Random(f"edl-argo/{self._config.seed}/{epoch}").shuffle(ranges)
        return ranges

    def _add_tasks(
        self, task_type: TaskType, shards: Mapping[str, int], epoch: int, model_version: int
    ) -> int:
        """Append the ranges of ``shards`` to the todo queue of ``task_type``; return how many."""
        if task_type is TaskType.TRAINING:
            ranges = self._epoch_ranges(epoch)
        else:
            ranges = _cut(shards, self._config.records_per_task, epoch, model_version)
        self._fresh[task_type].extend(ranges)
        if task_type is not TaskType.TRAINING:  # training totals are known up front
            self._tasks_created[task_type] += len(ranges)
        return len(ranges)

    def _has_todo(self, task_type: TaskType) -> bool:
        return bool(self._requeued[task_type] or self._fresh[task_type])

    def _pop_todo(self, task_type: TaskType) -> Task | None:
        """The front of the todo queue of ``task_type`` (None if empty); fresh ranges get their id here."""
        if self._requeued[task_type]:
            return self._requeued[task_type].popleft()
        if not self._fresh[task_type]:
            return None
        shard, start, end, epoch, model_version = self._fresh[task_type].popleft()
        task_id = self._next_task_id
        self._next_task_id += 1
        return Task(task_id, task_type, shard, start, end, epoch, model_version)

    def _start(self, task: Task, worker_id: int, started: float) -> None:
        running = _Running(task, worker_id, started)
        self._doing[task.task_id] = running
        self._saved_doing[str(task.task_id)] = running.to_json()
        self._doing_by_type[task.type][task.task_id] = running
        self._held.setdefault(worker_id, {})[task.task_id] = None

    def _stop(self, task_id: int) -> _Running:
        running = self._doing.pop(task_id)
        del self._saved_doing[str(task_id)]
        del self._doing_by_type[running.task.type][task_id]
        held = self._held[running.worker_id]
        del held[task_id]
        if not held:
            del self._held[running.worker_id]
        return running

    def _requeue(self, running: list[_Running], reason: RequeueReason) -> None:
        """Move held tasks back to the front of their queues, keeping their relative order."""
        for r in reversed(running):
            self._stop(r.task.task_id)
            self._requeued[r.task.type].appendleft(r.task)
            self._requeues[reason] += 1
            if r.task.type is TaskType.TRAINING:
                self._records_trained_twice += r.task.num_records
            log.info("task_requeued", task=r.task.task_id, worker=r.worker_id, reason=reason)

    def _timeout(self, task_type: TaskType) -> float:
        durations = self._durations[task_type]
        if len(durations) < MIN_DURATIONS_FOR_TIMEOUT:
            return self._config.initial_task_timeout
        return max(self._config.task_timeout_floor, self._config.task_timeout_factor * max(durations))

    def _finished_locked(self) -> bool:
        if self._failure is not None:
            return True
        return (
            not self._doing
            and not any(self._has_todo(t) for t in TaskType)
            and self._tasks_done[TaskType.TRAINING] == self._tasks_created[TaskType.TRAINING]
        )

    def _evaluation_task_done(self, model_version: int) -> int | None:
        """Count one evaluation task of ``model_version`` done; return the version if its round is over."""
        left = self._evaluations_pending[model_version] - 1
        if left:
            self._evaluations_pending[model_version] = left
            return None
        del self._evaluations_pending[model_version]
        return model_version

    def _same_model_error(self, task: Task, worker_id: int, error: str) -> bool:
        """Whether another worker reported ``error`` as a model error of ``task`` last; if so the job
        fails with it, else it is remembered as this worker's."""
        first_worker, first_error = self._model_errors.get(task.task_id, (worker_id, ""))
        if first_worker == worker_id or first_error != error:
            self._model_errors[task.task_id] = (worker_id, error)
            return False
        if self._failure is None:
            self._failure = JobFailedError(
                f"{error} ({task.describe()} failed so on workers {first_worker} and {worker_id}; the model"
                " fails the same way wherever it runs)"
            )
            log.error("job_failed", task=task.task_id, shard=task.shard, model_error=True, error=error)
        return True

    def _fail(self, task: Task, failures: int, error: str) -> None:
        if self._failure is not None:
            return
        self._failure = JobFailedError(
            f"{task.describe()} failed {failures} times (max_task_retries={self._config.max_task_retries});"
            f" last error: {error or 'none reported'}"
        )
        log.error("job_failed", task=task.task_id, shard=task.shard, failures=failures, error=error)

    def _log_ignored(self, task_id: int, worker_id: int, running: _Running | None) -> None:
        if running is not None:
            log.warning("report_ignored", task=task_id, worker=worker_id, holder=running.worker_id)
        elif 0 < task_id < self._next_task_id:
            log.debug("report_ignored", task=task_id, worker=worker_id, reason="not_held")
        else:
            log.warning("report_ignored", task=task_id, worker=worker_id, reason="unknown_task")

    def _notify_evaluation_complete(self, model_version: int) -> None:
        log.info("evaluation_complete", model_version=model_version)
        if self._on_evaluation_complete is not None:
            self._on_evaluation_complete(model_version)
