"""The master's state in the job's storage, and when it is written: what a restarted master continues from.
What the state holds and how a restarted master uses it: :mod:`edl_argo.master.failover`.

**Where: a snapshot and a log of changes.** ``<output>/master/state.json`` (:data:`STATE_KEY`, written
through the ``--master-state`` storage, default ``--output``, so on S3 too) is a *snapshot*: the parts of
:data:`~edl_argo.master.failover.STATE_PARTS` (those of :data:`~edl_argo.master.failover.LATER_PARTS` may be
missing from a file saved before they existed), the job name and a :func:`job_fingerprint` of the settings
a job cannot change while it runs, the layout's :data:`STATE_FORMAT`, and ``log.next``: the number of the
first *segment* that follows it. Each later save writes one segment, ``master/state-log/<number>.json``
(:func:`segment_key`, numbers consecutive): the changes since the save before, as a patch
(:mod:`edl_argo.master.state_log`), one object written whole (storage writes are atomic; S3 has no append).
So a save writes what changed, not the whole state: its bytes do not grow with the tasks queued or done,
the epochs or the workers. A store's first save writes a snapshot (numbered past every segment it finds,
which it deletes); after :data:`COMPACT_SEGMENTS` segments, or once they hold more bytes than the snapshot
(at least :data:`COMPACT_MIN_BYTES`), a *compaction* writes the state of the newest save as a new snapshot,
on a thread of its own so that no save waits for it, then deletes the segments it replaces. A restore
ignores segments numbered below its snapshot's ``log.next``, so a compaction is complete the moment its
snapshot is written, and one that fails or is cut short changes nothing.

**When it is written: group commit.** A :class:`GroupCommit` thread writes the newest state whenever
something changed, one write at a time, and never from the dispatcher (which stays pure bookkeeping).
:class:`DurableMasterServicer` answers a worker only once a write that *started after* the worker's
change has completed: accepting a task report, evaluation outputs, a scaling request. Concurrent requests
share writes, so a busy master makes about one write per write's duration, whatever the number of
workers; each such request waits for one to two writes. Handing out a task and pod events (a worker died,
its tasks requeued, a replacement started) ask for a write without waiting. Hence an accepted report is
never repeated, and a restart repeats at most the tasks that were in flight: a task a worker holds is
usually held by it in the saved state (and stays its task if the worker survives; if the worker never got
the reply that gave it, it gets it again: :func:`~edl_argo.master.failover.lost_reply`); one handed out
just before the master died goes back to the queue. A segment whose write failed is written again, under
the same number, with every change since the last completed save: the log never has a gap.

**Restore.** :meth:`MasterStateStore.load` returns the saved state (the snapshot with its segments applied
in order), or None when there is none (a new job). State of another job name, or of settings that differ
from this run's, is a :class:`~edl_argo.errors.ConfigError` naming the file and what differs; an unreadable
snapshot, a missing segment, or an unreadable segment followed by others a
:class:`~edl_argo.errors.DataFormatError` naming it. An unreadable *last* segment is a save that never
completed (no worker was answered on it): it is left out, logged as ``master_state_segment_ignored``. The
master removes the state once the model is published (or the job failed for good), so a finished job never
restores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from edl_argo.errors import ConfigError, DataFormatError, StorageError
from edl_argo.log import get_logger
from edl_argo.master import state_log
from edl_argo.master.config import TrainConfig
from edl_argo.master.failover import STATE_PARTS
from edl_argo.master.servicer import MasterServicer
from edl_argo.master.task_dispatcher import TaskDispatcher
from edl_argo.proto import master_pb2, tensor_pb2
from edl_argo.rpc.auth import JobSecret
from edl_argo.rpc.channel import reject_request
from edl_argo.storage import Storage
from edl_argo.storage.local import LocalStorage

log = get_logger(__name__)

#: Where the state's snapshot lives, relative to the job's ``--output``; its segments below LOG_PREFIX.
STATE_KEY = "master/state.json"
LOG_PREFIX = "master/state-log/"
#: A save compacts after this many segments (a restore reads at most this many) or once the segments hold
#: more bytes than the snapshot and at least COMPACT_MIN_BYTES.
COMPACT_SEGMENTS = 500
COMPACT_MIN_BYTES = 1 << 20
#: Where the job's secret lives when the pod backend does not keep it (the local backend), beside the state.
SECRET_KEY = "master/job-secret"
#: How long :meth:`MasterStateStore.wait_for_compaction` waits by default, at most.
COMPACTION_JOIN_SECONDS = 60.0
#: Version of the state file's layout; a file of another version is not restored.
STATE_FORMAT = 1
#: The :class:`~edl_argo.master.config.TrainConfig` fields a job cannot change while it runs: how tasks
#: are cut and ordered, what model is trained how, where the data is.
FINGERPRINT_FIELDS = (
    "model_def",
    "model_options",
    "training_data",
    "validation_data",
    "num_epochs",
    "minibatch_size",
    "num_minibatches_per_task",
    "shuffle",
    "seed",
    "num_ps",
    "use_async",
    "grads_to_wait",
    "evaluation_steps",
    "backend",
)
#: How long a request waits for its change to be saved before it is answered anyway (storage trouble), at
#: most: never more than half the workers' call deadline (:func:`commit_wait_seconds`).
COMMIT_WAIT_SECONDS = 60.0
#: Threads of the master's gRPC server, and how many of them may wait for a state save at once: the
#: others always serve GetTask, ReportVersion and the AllreduceStrategy rendezvous, however slow a save.
#: A job of many workers has more of both (:func:`save_waiters`): one more waiter per
#: :data:`WORKERS_PER_SAVE_WAITER` workers it may have, so that its reports wait for a save rather than be
#: answered UNAVAILABLE and retried after the worker's backoff (a tail of a second and more on S3).
MASTER_THREADS = 16
SAVE_WAITERS = 12
WORKERS_PER_SAVE_WAITER = 25
#: Backoff of a failed write: first delay, doubled up to the maximum.
RETRY_FIRST_SECONDS, RETRY_MAX_SECONDS = 0.5, 10.0


def save_waiters(max_workers: int) -> int:
    """How many requests may wait for a save at once in a job of at most ``max_workers`` workers:
    :data:`SAVE_WAITERS`, or one per :data:`WORKERS_PER_SAVE_WAITER` workers if more."""
    return max(SAVE_WAITERS, -(-max_workers // WORKERS_PER_SAVE_WAITER))


def master_threads(max_workers: int) -> int:
    """Threads of the master's progress calls in a job of at most ``max_workers`` workers: its
    :func:`save_waiters`, and as many others as :data:`MASTER_THREADS` leaves beside :data:`SAVE_WAITERS`."""
    return save_waiters(max_workers) + MASTER_THREADS - SAVE_WAITERS


def commit_wait_seconds(rpc_timeout_seconds: float) -> float:
    """How long a request waits for its save: answered before the caller's deadline of
    ``rpc_timeout_seconds`` (else the caller gives up and retries while the first one still waits)."""
    return min(COMMIT_WAIT_SECONDS, rpc_timeout_seconds / 2)


def segment_key(number: int) -> str:
    """The key of segment ``number`` of the state's log."""
    return f"{LOG_PREFIX}{number:012d}.json"


def _segment_number(key: str) -> int | None:
    name = key[len(LOG_PREFIX) :]
    stem = name.removesuffix(".json")
    return int(stem) if key.startswith(LOG_PREFIX) and stem.isdigit() and name.endswith(".json") else None


def job_fingerprint(
    config: TrainConfig, training_shards: Mapping[str, int], validation_shards: Mapping[str, int]
) -> dict[str, Any]:
    """The settings of :data:`FINGERPRINT_FIELDS` plus the records per task and a digest of the shards
    (key and record count of each), as JSON data: a job restores only a state with the same."""
    fingerprint: dict[str, Any] = {name: _json(getattr(config, name)) for name in FINGERPRINT_FIELDS}
    fingerprint["records_per_task"] = config.records_per_task
    fingerprint["training_shards"] = _digest(training_shards)
    fingerprint["validation_shards"] = _digest(validation_shards)
    return fingerprint


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _json(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _digest(shards: Mapping[str, int]) -> str:
    text = json.dumps(sorted(shards.items()))
    return f"{len(shards)} shards, sha256:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


class MasterStateStore:
    """Reads, writes and removes the state of job ``job_name`` in ``storage``: a snapshot at
    :data:`STATE_KEY` and the segments that follow it (see the module docstring). :meth:`save` is called
    from one thread at a time (the :class:`GroupCommit` thread)."""

    def __init__(self, storage: Storage, job_name: str, fingerprint: Mapping[str, Any]) -> None:
        self.storage = storage
        self.job_name = job_name
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back
        self.url = storage.describe(STATE_KEY)
        self._base: Mapping[str, Any] | None = None  # the state as last saved: what the next segment changes
        self._next_segment = 0
        self._segments_since_snapshot = 0
        self._segment_bytes = 0
        self._snapshot_bytes = 0
        self._compactor: threading.Thread | None = None
        self._compaction_lock = threading.Lock()
        self._removed = False
        self.compactions = 0
        """How many snapshots this store wrote (for logs and tests)."""

    def load(self) -> dict[str, Any] | None:
        """The saved state of this job (every part of :data:`STATE_PARTS`), or None if there is none.

        Raises:
            ConfigError: the state is of another job name, or of different settings.
            DataFormatError: the snapshot or a segment is not a state this version can read.
            StorageError: the state cannot be read.
        """
        if not self.storage.exists(STATE_KEY):
            return None
        try:
            state = json.loads(self.storage.read(STATE_KEY))
        except (ValueError, UnicodeDecodeError) as error:
            raise self.corrupt(f"not JSON: {error}") from None
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise self.corrupt(f"format {found!r}, expected {STATE_FORMAT}")
        missing = [part for part in ("job_name", "fingerprint", *STATE_PARTS) if part not in state]
        if missing:
            raise self.corrupt(f"no {', '.join(missing)}")
        if state["job_name"] != self.job_name:
            raise ConfigError(
                f"{self.url} holds the state of job {state['job_name']!r}, not of {self.job_name!r}: run"
                f" with --job-name {state['job_name']} to continue that job, or delete the file (or choose"
                " another --output) to start a new one"
            )
        saved = state["fingerprint"] if isinstance(state["fingerprint"], dict) else {}
        changed = [
            f"{name} {saved.get(name)!r} then, {self.fingerprint.get(name)!r} now"
            for name in sorted(set(saved) | set(self.fingerprint))
            if saved.get(name) != self.fingerprint.get(name)
        ]
        if changed:
            raise ConfigError(
                f"{self.url}: job {self.job_name} was started with other settings ({'; '.join(changed)});"
                " rerun it with the same settings to continue it, or delete the file (or choose another"
                " --output) to start it afresh"
            )
        log_info = state.pop("log", None)
        if log_info is not None:  # a snapshot saved before the log existed has no segments
            try:
                first = int(log_info["next"])
            except (KeyError, TypeError, ValueError):
                raise self.corrupt(f"log {log_info!r}") from None
            self._apply_segments(state, first)
        return state

    def _segments(self) -> list[tuple[int, str]]:
        """The number and key of every segment of the log in storage, in order."""
        return sorted(
            (n, info.key)
            for info in self.storage.list(LOG_PREFIX)
            if (n := _segment_number(info.key)) is not None
        )

    def _apply_segments(self, state: dict[str, Any], first: int) -> None:
        """Apply the segments numbered ``first`` on to ``state``, in order (see the module docstring)."""
        numbers = [number for number, _ in self._segments()]
        self._next_segment = max([first - 1, *numbers]) + 1
        following = [n for n in numbers if n >= first]
        for position, number in enumerate(following):
            key = segment_key(number)
            if number != first + position:
                raise self.corrupt(f"segment {first + position} of its log is missing ({key} follows)")
            try:
                segment = json.loads(self.storage.read(key))
                if segment.get("segment") != number:
                    raise ValueError(f"it says it is segment {segment.get('segment')!r}")
                state_log.apply(state, segment["patch"])
            except (ValueError, UnicodeDecodeError, KeyError, AttributeError, TypeError) as error:
                if position == len(following) - 1:  # the last: a save that never completed
                    log.warning(
                        "master_state_segment_ignored", segment=self.storage.describe(key), error=str(error)
                    )
                    return
                raise self.corrupt(f"segment {self.storage.describe(key)}: {error}") from None

    def save(self, parts: Mapping[str, Any]) -> None:
        """Save ``parts`` (every part of :data:`STATE_PARTS`): a segment of what changed since the last
        save, or a new snapshot (see the module docstring). A save that raises left the saved state as it
        was before it (the next save covers its changes too)."""
        state = {
            "format": STATE_FORMAT,
            "job_name": self.job_name,
            "fingerprint": self.fingerprint,
            "saved_at": time.time(),
            **parts,
        }
        if self._base is None:
            self._first_snapshot(state)
            return
        number = self._next_segment
        data = _dumps({"segment": number, "patch": state_log.diff(self._base, state)})
        self.storage.write(segment_key(number), data)
        self._base = state
        self._next_segment = number + 1
        self._segments_since_snapshot += 1
        self._segment_bytes += len(data)
        due = self._segments_since_snapshot >= COMPACT_SEGMENTS or self._segment_bytes > max(
            COMPACT_MIN_BYTES, self._snapshot_bytes
        )
        if due and (self._compactor is None or not self._compactor.is_alive()):
            self._segments_since_snapshot, self._segment_bytes = 0, 0
            self._compactor = threading.Thread(
                target=self._compact, args=(state, number + 1), name="master-state-compaction", daemon=True
            )
            self._compactor.start()

    def _first_snapshot(self, state: Mapping[str, Any]) -> None:
        """This store's first save: a snapshot numbered past any segment an earlier run left."""
        self._next_segment = max([self._next_segment - 1, *(number for number, _ in self._segments())]) + 1
        data = _dumps({**state, "log": {"next": self._next_segment}})
        with self._compaction_lock:
            self._removed = False
            self.storage.write(STATE_KEY, data)
        self._base = state
        self._segments_since_snapshot = self._segment_bytes = 0
        self._snapshot_bytes = len(data)
        self.compactions += 1
        self._delete_segments(self._next_segment)

    def _compact(self, state: Mapping[str, Any], following: int) -> None:
        """Write ``state`` (saved up to segment ``following - 1``) as the snapshot, then delete the
        segments it replaces; on the compaction thread, so that no save waits for it. A failure is logged
        and changes nothing: the snapshot before and the segments since still hold the state, and the next
        save that finds a compaction due tries again."""
        try:
            data = _dumps({**state, "log": {"next": following}})
            with self._compaction_lock:
                if self._removed:
                    return
                self.storage.write(STATE_KEY, data)
        except StorageError as error:
            log.warning("master_state_compaction_failed", error=str(error))
            self._segments_since_snapshot = COMPACT_SEGMENTS  # due again at the next save
            return
        self._snapshot_bytes = len(data)
        self.compactions += 1
        self._delete_segments(following)

    def wait_for_compaction(self, timeout: float = COMPACTION_JOIN_SECONDS) -> bool:
        """Wait (at most ``timeout`` seconds) for a compaction in progress; whether none is left."""
        if self._compactor is not None:
            self._compactor.join(timeout)
        return self._compactor is None or not self._compactor.is_alive()

    def _delete_segments(self, below: int | None) -> None:
        """Delete the log's segments numbered below ``below`` (None: all); a failure is logged, and the
        next compaction deletes what this one left."""
        try:
            for number, key in self._segments():
                if below is None or number < below:
                    self.storage.delete(key)
        except StorageError as error:
            log.warning("master_state_sweep_failed", error=str(error))

    def remove(self) -> None:
        """Delete the state (snapshot and segments) and the job's secret (the job is over); deleting none
        is fine."""
        with self._compaction_lock:  # a compaction still running writes nothing after this
            self._removed = True
        self.storage.delete(STATE_KEY)
        self._delete_segments(None)
        self.storage.delete(SECRET_KEY)
        self._base = None

    def load_secret(self) -> JobSecret | None:
        """The job secret an earlier master of this job saved with :meth:`save_secret`, or None."""
        if not self.storage.exists(SECRET_KEY):
            return None
        return JobSecret.from_hex(
            self.storage.read(SECRET_KEY).decode(errors="replace"), self.storage.describe(SECRET_KEY)
        )

    def save_secret(self, secret: JobSecret) -> None:
        """Keep ``secret`` for a restarted master (a local file is made readable by its owner only)."""
        self.storage.write(SECRET_KEY, secret.hex().encode())
        if isinstance(self.storage, LocalStorage):
            os.chmod(self.storage.root / SECRET_KEY, 0o600)

    def corrupt(self, problem: str) -> DataFormatError:
        """The error for a state file that cannot be restored."""
        return DataFormatError(
            f"master state {self.url} cannot be restored ({problem}); delete it to start the job afresh"
        )


@dataclass(frozen=True)
class SaveRecord:
    """One completed save of the state: when it completed (``time.time()``) and how long it took, the
    snapshot included (seconds)."""

    at: float
    seconds: float


class GroupCommit:
    """A thread that saves the newest state whenever something changed, one save at a time.

    ``snapshot()`` makes the state (taken on this thread, just before each save), ``save(state)`` writes
    it. :meth:`commit` records a change and waits until a save that started after it has completed;
    :meth:`changed` records one without waiting. A save that fails with a storage error is logged and
    retried with backoff; a waiting caller gives up after ``wait_seconds`` and goes on. Any other error
    (a bug) stops the thread: it is kept in :attr:`failure` and waiting callers are released.
    """

    def __init__(
        self,
        snapshot: Callable[[], Mapping[str, Any]],
        save: Callable[[Mapping[str, Any]], None],
        *,
        wait_seconds: float = COMMIT_WAIT_SECONDS,
    ) -> None:
        self._snapshot = snapshot
        self._save = save
        self._wait_seconds = wait_seconds
        self._ready = threading.Condition()
        self._requested = 0  # the number of the newest change
        self._saved = 0  # every change up to this number is saved
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="master-state", daemon=True)
        self.saves = 0
        """How many saves completed (for logs and tests)."""
        self.last_save: SaveRecord | None = None
        """The newest completed save (for the live metrics), None before the first."""
        self.failure: BaseException | None = None

    def start(self) -> None:
        """Start saving; :meth:`commit` calls made before wait for the first save."""
        self._thread.start()

    def changed(self) -> None:
        """Record a change; the next save includes it."""
        with self._ready:
            self._requested += 1
            self._ready.notify_all()

    def commit(self) -> bool:
        """Record a change and wait until it is saved; False if that took longer than ``wait_seconds``
        (or saving stopped)."""
        with self._ready:
            self._requested += 1
            ticket = self._requested
            self._ready.notify_all()
            self._ready.wait_for(lambda: self._saved >= ticket or self._closed, self._wait_seconds)
            saved = self._saved >= ticket
        if not saved:
            log.warning("master_state_not_saved", waited_s=self._wait_seconds)
        return saved

    def close(self) -> None:
        """Stop saving (changes not saved yet stay unsaved) and release waiting callers. Idempotent."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        delay = RETRY_FIRST_SECONDS
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._requested > self._saved or self._closed)
                if self._closed:
                    return
                target = self._requested
            started = time.monotonic()
            try:
                self._save(self._snapshot())
            except StorageError as error:
                log.warning("master_state_save_failed", error=str(error), retry_in_s=delay)
                with self._ready:
                    self._ready.wait_for(lambda: self._closed, delay)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                continue
            except BaseException as error:  # a bug: surfaced by the master's main loop
                log.error("master_state_writer_failed", error=f"{type(error).__name__}: {error}")
                with self._ready:
                    self.failure = error
                    self._closed = True
                    self._ready.notify_all()
                return
            delay = RETRY_FIRST_SECONDS
            saved = SaveRecord(time.time(), time.monotonic() - started)
            with self._ready:
                self.saves += 1
                self.last_save = saved
                self._saved = max(self._saved, target)
                self._ready.notify_all()


class DurableMasterServicer(MasterServicer):
    """The master's service, answering a request that changed the job's state once that is saved.

    ReportTaskResult, ReportEvaluationOutputs and ScaleWorkers wait for ``commit.commit()``, at most
    ``save_waiters`` of them at once: one more is answered UNAVAILABLE at once (its change is made and will
    be saved; the worker retries, and the retry is answered as the first would have been), so requests
    that wait for a slow save never take every server thread from the others. GetTask
    (when it hands out a task) and ReportVersion (which may queue an evaluation round) only call
    ``commit.changed()``: a task handed out but not saved yet is in flight, and in flight is what a restart
    may repeat, so the worker need not wait (every task would otherwise cost two saves instead of one).
    Everything else is :class:`~edl_argo.master.servicer.MasterServicer`'s (a reply lost with a master
    restart included: :func:`~edl_argo.master.failover.lost_reply`).
    """

    def __init__(
        self,
        dispatcher: TaskDispatcher,
        *args: Any,
        commit: GroupCommit,
        save_waiters: int = SAVE_WAITERS,
        **kwargs: Any,
    ) -> None:
        super().__init__(dispatcher, *args, **kwargs)
        self._commit = commit
        self._save_waiters = threading.BoundedSemaphore(save_waiters)

    def GetTask(
        self, request: master_pb2.GetTaskRequest, context: grpc.ServicerContext
    ) -> master_pb2.GetTaskResponse:
        response = super().GetTask(request, context)
        if response.kind == master_pb2.GetTaskResponse.TASK:
            self._commit.changed()
        return response

    def ReportTaskResult(
        self, request: master_pb2.ReportTaskResultRequest, context: grpc.ServicerContext
    ) -> master_pb2.ReportTaskResultResponse:
        response = super().ReportTaskResult(request, context)
        self._answer_once_saved(context, "ReportTaskResult")
        return response

    def ReportEvaluationOutputs(
        self, request: master_pb2.ReportEvaluationOutputsRequest, context: grpc.ServicerContext
    ) -> tensor_pb2.Empty:
        response = super().ReportEvaluationOutputs(request, context)
        self._answer_once_saved(context, "ReportEvaluationOutputs")
        return response

    def ReportVersion(
        self, request: master_pb2.ReportVersionRequest, context: grpc.ServicerContext
    ) -> tensor_pb2.Empty:
        response = super().ReportVersion(request, context)
        self._commit.changed()
        return response

    def ScaleWorkers(
        self, request: master_pb2.ScaleWorkersRequest, context: grpc.ServicerContext
    ) -> master_pb2.ScaleWorkersResponse:
        response = super().ScaleWorkers(request, context)
        self._answer_once_saved(context, "ScaleWorkers")
        return response

    def _answer_once_saved(self, context: grpc.ServicerContext, rpc: str) -> None:
        """Wait for the change just made to be saved, if a waiting slot is free; else UNAVAILABLE."""
        if not self._save_waiters.acquire(blocking=False):
            reject_request(context, rpc, grpc.StatusCode.UNAVAILABLE, "the master is saving its state; retry")
        try:
            self._commit.commit()
        finally:
            self._save_waiters.release()
