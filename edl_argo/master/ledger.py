"""What the workers say they trained, checked against what the master handed out.

The dispatcher counts a task's records once the task is reported done, so its count can never disagree
with itself. The ledger counts at the other end. With each training task a worker reports the records its
input actually yielded (``records``), the minibatches it trained (``steps``: pushed and applied, or
stepped with the group) and those it skipped for a NaN loss or NaN gradients (``nan_batches_skipped``,
``nan_gradients_skipped``) or because their scaled gradients overflowed under ``LossScaleOptimizer``'s
dynamic loss scale (``loss_scale_skipped``, a step ``fit`` skips too); a failed attempt reports the
minibatches it trained before it failed. The master checks:

* **per task**, when it is reported done: ``records`` equals the task's size and ``steps`` plus the
  skipped minibatches (:data:`SKIPPED_COUNTERS`) equals ``ceil(records / minibatch_size)``. A task that
  fails this fails the job at once, naming the task: running it elsewhere would not make a worker's input
  right.
* **per epoch**, at the end: the records reported equal the dataset's.
* **per parameter server**, at the end: its model version equals the updates the minibatches make,
  ``ceil(minibatches / grads_to_wait)`` (the last, partial step is applied when training ends). Pushes
  the PS refused as stale are not minibatches trained: the worker computed them again. Attempts that ended
  without a report (their worker died or timed out) may have pushed any part of their task, so then the
  expectation is a range. A PS that restarted from its checkpoint lost the updates since that checkpoint:
  ``updates_lost_to_rollback`` counts them (exactly when nothing else is unknown); a PS that did not
  restart must be exactly in the range, else the job fails. Since ``grads_to_wait`` minibatches make one
  update, a version count cannot see a minibatch applied twice within a step; so every PS also counts the
  pushes it accepted (``pushes_accepted``; repeats it recognised are not counted, nor refused pushes), which
  must equal the minibatches exactly (within the same range when attempts ended unreported; at most its
  upper end for a PS that restarted, whose count starts again). A training task reported done that the master
  ignored (it was not the worker's any more, or a master that died before saving handed it out, so the
  restarted one gave its records out again) was trained too: its minibatches count (:meth:`add_ignored`),
  except those of a report sent again after its reply was lost, which counted the first time.

**Folding.** Per task, the ledger keeps what it needs to count a resent report once: memory and saved state
grow with the tasks of the job (100 epochs of 100,000 tasks: gigabytes). :meth:`fold_complete_epochs`, called
from the master's loop, keeps only the totals of an epoch whose every task was done
:data:`FOLD_AFTER_SECONDS` ago or more: by then no report of its tasks can still be accepted (they are all
done), and none can still be resent after a lost reply (a worker gives a call up after its retry budget,
300 s). A report of a folded epoch's task that does come is not counted again; its minibatches would be
counted as an ignored report's (:meth:`add_ignored` no longer knows who reported the task).

Thread-safe; :meth:`snapshot` and :meth:`restore` carry it across a master restart.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edl_argo.errors import first_few
from edl_argo.master.task_dispatcher import Accounting, Task

#: How long after an epoch's last task was done the ledger keeps only the epoch's totals (see the module
#: docstring): twice the worker's retry budget for one call.
FOLD_AFTER_SECONDS = 600.0
#: Task ids per bucket of the ledger's snapshot (:meth:`TrainingLedger.snapshot`).
TASK_BUCKET = 1024
#: The counters of a task report that count minibatches trained but not pushed (nothing of them applied).
SKIPPED_COUNTERS = ("nan_batches_skipped", "nan_gradients_skipped", "loss_scale_skipped")


def accounting_failure(problems: Sequence[str]) -> str:
    """The job's one-line error for ``problems`` (of :meth:`TrainingLedger.epoch_problems` and
    :meth:`TrainingLedger.ps_updates`): the first few, and how many more there are (a job of many epochs
    that went wrong in every one has a problem per epoch)."""
    return first_few(problems, "more problems of the same accounting")


def _minibatches(records: int, minibatch_size: int) -> int:
    return -(-records // minibatch_size)


@dataclass(frozen=True)
class PsReport:
    """What one parameter server said at the end of training (its ``GetStatus``)."""

    ps_id: int
    version: int
    pushes_refused: int
    restored_version: int  # -1: it never restarted from a checkpoint
    #: Pushes it accepted since it started (None: not known, e.g. a PS of an older version).
    pushes_accepted: int | None = None
    #: The bytes of those pushes' gradients (None: not known).
    gradient_bytes_accepted: int | None = None


def _push_problems(report: PsReport, low: int, high: int) -> list[str]:
    """Why ``report``'s accepted pushes do not fit the ``low``..``high`` minibatches trained (empty if they
    do; a PS that restarted counts only the pushes since, so only the upper bound holds for it)."""
    accepted = report.pushes_accepted
    assert accepted is not None
    if accepted > high:
        return [
            f"accounting: PS {report.ps_id} accepted {accepted} pushes, but the workers trained "
            f"{low if low == high else f'{low} to {high}'} minibatches: it took some twice"
        ]
    if accepted < low and report.restored_version < 0:
        return [
            f"accounting: PS {report.ps_id} accepted {accepted} pushes, but the workers trained {low} "
            "minibatches and it never restarted: pushes were lost"
        ]
    return []


class TrainingLedger:
    """Per-task and per-epoch records and minibatches reported by workers (see the module docstring)."""

    def __init__(self, minibatch_size: int, grads_to_wait: int = 1) -> None:
        self._minibatch_size = minibatch_size
        self._grads_to_wait = grads_to_wait
        self._lock = threading.Lock()
        # Task id -> (epoch, records, minibatches) of the training tasks reported done. Keyed by task so that
        # counting one again (a master restart between this and the dispatcher's save) changes nothing.
        self._tasks: dict[int, tuple[int, int, int]] = {}
        self._failed_steps = 0  # minibatches of attempts reported failed
        self._reporters: dict[int, int] = {}  # task id -> the worker whose report of it counts
        self._ignored: dict[
            tuple[int, int], int
        ] = {}  # (task id, worker id) -> minibatches, of ignored reports
        # The snapshot's tasks in buckets of TASK_BUCKET ids, each made again only once it changed.
        self._saved_buckets: dict[int, dict[str, list[int | None]]] = {}
        self._changed_tasks: set[int] = set()
        self._folded: dict[int, tuple[int, int]] = {}  # epoch -> (records, minibatches), tasks forgotten
        self._complete_since: dict[int, float] = {}  # epoch -> when it was first seen complete

    def check(self, task: Task, counters: Mapping[str, int]) -> str | None:
        """Why the report of ``task`` done with ``counters`` is wrong, or None if it adds up."""
        records = counters.get("records")
        steps = counters.get("steps")
        if records is None or steps is None:
            return f"{task.describe()}: the worker reported no records or steps"
        skipped = sum(counters.get(name, 0) for name in SKIPPED_COUNTERS)
        expected = _minibatches(records, self._minibatch_size)
        if records != task.num_records or steps + skipped != expected:
            return (
                f"accounting: {task.describe()} has {task.num_records} records; the worker trained "
                f"{records} records in {steps} minibatches (+{skipped} skipped), expected "
                f"{_minibatches(task.num_records, self._minibatch_size)} minibatches of "
                f"{self._minibatch_size}"
            )
        return None

    def add(self, task: Task, counters: Mapping[str, int], worker_id: int = -1) -> None:
        """Count a task reported done by ``worker_id`` (after :meth:`check`; before the dispatcher marks it
        done)."""
        with self._lock:
            if task.epoch in self._folded:
                return  # counted in its epoch's totals
            self._tasks[task.task_id] = (task.epoch, counters.get("records", 0), counters.get("steps", 0))
            self._reporters[task.task_id] = worker_id
            self._changed_tasks.add(task.task_id)

    def remove(self, task: Task) -> None:
        """Forget a task :meth:`add` counted whose report the dispatcher then refused."""
        with self._lock:
            if task.epoch in self._folded:
                return
            self._tasks.pop(task.task_id, None)
            self._reporters.pop(task.task_id, None)
            self._changed_tasks.add(task.task_id)

    def add_ignored(self, task_id: int, worker_id: int, counters: Mapping[str, int]) -> None:
        """Count the minibatches (``steps``) of a report of task ``task_id`` done that the master ignored:
        they reached the PS. Not when the task counted from this worker's report (this one was sent again
        after its reply was lost, or counted by a state that did not name the reporter); once per task and
        worker however often it is sent."""
        if "steps" not in counters:
            return  # not a training task
        with self._lock:
            if task_id in self._tasks and self._reporters.get(task_id, worker_id) == worker_id:
                return
            self._ignored[(task_id, worker_id)] = counters["steps"]

    def add_failed_attempt(self, counters: Mapping[str, int]) -> None:
        """Count the minibatches an attempt trained before it failed (they reached the PS)."""
        with self._lock:
            self._failed_steps += counters.get("steps", 0)

    @property
    def minibatches(self) -> int:
        """Minibatches of the training tasks reported done."""
        with self._lock:
            folded = sum(steps for _, steps in self._folded.values())
            return folded + sum(steps for _, _, steps in self._tasks.values())

    def records_per_epoch(self) -> dict[int, int]:
        """Epoch -> records of its training tasks reported done."""
        with self._lock:
            records = {epoch: count for epoch, (count, _) in self._folded.items()}
            for epoch, count, _ in self._tasks.values():
                records[epoch] = records.get(epoch, 0) + count
            return records

    def epoch_problems(self, accounting: Accounting) -> list[str]:
        """Epochs whose reported records differ from the dataset's (empty when all add up)."""
        records = self.records_per_epoch()
        return [
            f"accounting: epoch {epoch}: workers reported {records.get(epoch, 0)} records trained, the "
            f"dataset has {accounting.records_per_epoch}"
            for epoch in sorted(accounting.records_done_per_epoch)
            if records.get(epoch, 0) != accounting.records_per_epoch
        ]

    def ps_updates(self, accounting: Accounting, ps: Sequence[PsReport]) -> tuple[dict[str, Any], list[str]]:
        """The expected updates of every PS against their versions: the ``accounting`` section of
        metrics.json and the problems that fail the job."""
        trained = self.minibatches
        with self._lock:
            failed = self._failed_steps
            ignored = sum(self._ignored.values())
        known = trained + failed + ignored
        # Requeued attempts may have pushed up to all of their task's minibatches, plus rounding per task.
        unknown = _minibatches(accounting.records_trained_twice, self._minibatch_size) + sum(
            accounting.requeues.values()
        )
        unreported = accounting.records_trained_twice > 0
        low = _minibatches(known, self._grads_to_wait)
        high = _minibatches(known + unknown, self._grads_to_wait) if unreported else low
        rows, problems = [], []
        for report in ps:
            restarted = report.restored_version >= 0
            lost: int | None = low - report.version if not unreported else None
            row = {
                "ps": report.ps_id,
                "model_version": report.version,
                "updates_expected": low if not unreported else [low, high],
                "updates_lost_to_rollback": max(0, lost) if restarted and lost is not None else 0,
                "restored_from_version": report.restored_version,
                "pushes_refused": report.pushes_refused,
            }
            if restarted and lost is None:
                row["updates_lost_to_rollback"] = None  # unknown: some attempts ended unreported
            if report.pushes_accepted is not None:
                row["pushes_accepted"] = report.pushes_accepted
                problems += _push_problems(report, known, known + unknown if unreported else known)
            if report.gradient_bytes_accepted is not None:
                row["gradient_bytes_accepted"] = report.gradient_bytes_accepted
            rows.append(row)
            if report.version > high:
                problems.append(
                    f"accounting: PS {report.ps_id} is at model version {report.version}, but the workers "
                    f"trained only {known} minibatches (at most {high} updates): it applied some twice"
                )
            elif report.version < low and not restarted:
                problems.append(
                    f"accounting: PS {report.ps_id} is at model version {report.version}, but the workers "
                    f"trained {known} minibatches ({low} updates) and it never restarted: updates were lost"
                )
        lost_total = sum(r["updates_lost_to_rollback"] or 0 for r in rows)
        section = {
            "minibatches_trained": trained,
            "minibatches_of_failed_attempts": failed,
            "minibatches_of_ignored_reports": ignored,
            "records_reported_per_epoch": {str(k): v for k, v in sorted(self.records_per_epoch().items())},
            "grads_to_wait": self._grads_to_wait,
            "parameter_servers": rows,
            "updates_lost_to_rollback": lost_total,
        }
        shares = [r.gradient_bytes_accepted for r in ps if r.gradient_bytes_accepted is not None]
        if len(shares) == len(ps) and sum(shares):
            # How evenly the PS shared the gradients: 1 is even; the busiest PS sets a step's pace.
            section["gradient_bytes_max_over_mean"] = round(max(shares) * len(shares) / sum(shares), 4)
        return section, problems

    def fold_complete_epochs(self, accounting: Accounting, now: float) -> list[int]:
        """Keep only the totals of the epochs ``accounting`` shows complete since :data:`FOLD_AFTER_SECONDS`
        before ``now`` (a monotonic clock; an epoch is first seen complete by the call that sees it so);
        returns the epochs folded. Cost: O(tasks kept) when it folds, O(epochs) otherwise."""
        with self._lock:
            due = []
            for epoch, done in accounting.records_done_per_epoch.items():
                if epoch in self._folded or done != accounting.records_per_epoch:
                    continue
                if now - self._complete_since.setdefault(epoch, now) >= FOLD_AFTER_SECONDS:
                    due.append(epoch)
            if not due:
                return []
            folding = set(due)
            for epoch in due:
                self._folded[epoch] = (0, 0)
                self._complete_since.pop(epoch, None)
            for task_id, (epoch, records, steps) in list(self._tasks.items()):
                if epoch in folding:
                    total_records, total_steps = self._folded[epoch]
                    self._folded[epoch] = (total_records + records, total_steps + steps)
                    del self._tasks[task_id]
                    self._reporters.pop(task_id, None)
                    self._changed_tasks.add(task_id)
        return due

    def snapshot(self) -> dict[str, Any]:
        """The counts as JSON data; :meth:`restore` is its inverse.

        The tasks (``task_buckets``: bucket -> task id -> ``[epoch, records, minibatches, reporter]``) are
        in buckets of :data:`TASK_BUCKET` ids, and a bucket no task of which changed since the last
        snapshot is the same object as in it (shared: not to be changed), so that a snapshot costs, and a
        state log saves (:mod:`edl_argo.master.state_log`), what changed, not every task the job did."""
        with self._lock:
            remade: dict[int, dict[str, list[int | None]]] = {}
            for task_id in self._changed_tasks:
                bucket = task_id // TASK_BUCKET
                if bucket not in remade:  # a new object: the one the last snapshot has is not changed
                    remade[bucket] = dict(self._saved_buckets.get(bucket, {}))
                if task_id in self._tasks:
                    remade[bucket][str(task_id)] = [*self._tasks[task_id], self._reporters.get(task_id)]
                else:
                    remade[bucket].pop(str(task_id), None)
            for bucket, saved in remade.items():
                if saved:
                    self._saved_buckets[bucket] = saved
                else:
                    self._saved_buckets.pop(bucket, None)
            self._changed_tasks.clear()
            return {
                "task_buckets": {str(bucket): saved for bucket, saved in self._saved_buckets.items()},
                "failed_steps": self._failed_steps,
                "folded_epochs": {str(epoch): list(totals) for epoch, totals in self._folded.items()},
                "ignored": [[task_id, worker, steps] for (task_id, worker), steps in self._ignored.items()],
            }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        with self._lock:
            if "task_buckets" in snapshot:
                entries = {
                    int(i): e for bucket in snapshot["task_buckets"].values() for i, e in bucket.items()
                }
                self._tasks = {
                    i: (int(epoch), int(records), int(steps))
                    for i, (epoch, records, steps, _) in entries.items()
                }
                self._reporters = {i: int(entry[3]) for i, entry in entries.items() if entry[3] is not None}
            else:  # saved before the buckets
                self._tasks = {
                    int(task_id): (int(epoch), int(records), int(steps))
                    for task_id, (epoch, records, steps) in snapshot["tasks"].items()
                }
                # Not in a state saved before they were: no reporter known.
                self._reporters = {
                    int(task_id): int(worker) for task_id, worker in snapshot.get("reporters", {}).items()
                }
            self._failed_steps = int(snapshot["failed_steps"])
            self._folded = {
                int(epoch): (int(records), int(steps))
                for epoch, (records, steps) in snapshot.get("folded_epochs", {}).items()
            }
            self._complete_since.clear()
            self._ignored = {(int(t), int(w)): int(steps) for t, w, steps in snapshot.get("ignored", [])}
            self._saved_buckets.clear()
            self._changed_tasks = set(self._tasks)
