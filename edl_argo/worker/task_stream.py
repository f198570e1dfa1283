"""The master's tasks for one worker as a stream, read one task ahead of the task being run.

:meth:`TaskStream.generate` is the generator the worker's input pipeline (:func:`edl_argo.worker.data.
stream_batches`) pulls from, on a tf.data thread: it yields ``(seq, records)`` per task. A thread of the
stream's own asks the master for each task and reads its records (one ranged read) while the worker trains
on the task before, so that the pipeline finds the next task ready when it asks. It holds at most
``1 + ahead`` tasks the worker has not finished (:meth:`TaskStream.finished`): the one being run and
``ahead`` fetched in advance. The master is told which tasks the worker holds with every request, so it
hands out a new one rather than the held one again.

A task fetched ahead and never started when the worker stops is not reported: like every task of a worker
that dies, the master requeues it when the worker's pod ends (or when the task times out).

What the worker sees, in order: every task's records (empty for evaluation and prediction tasks: the
worker runs those itself from :attr:`StreamedTask.records`) and :data:`WAIT_SEQ` when the master had no
task; the stream then waits until :meth:`TaskStream.resume`. The generator ends when the master says DONE,
when :meth:`TaskStream.close` is called, or when asking the master failed (:attr:`TaskStream.failure`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from edl_argo.proto import master_pb2
from edl_argo.readers import SERIALIZED, Records, RecordSchema
from edl_argo.worker.data import RecordSource

#: The ``seq`` of "the master has no task now" (a real task's seq is >= 0).
WAIT_SEQ = -1
#: How often a waiting generator or fetch thread checks whether the stream was closed (seconds).
POLL_SECONDS = 0.5


class TaskSource(Protocol):
    """The master client's part the stream uses."""

    def get_task(self, held_task_ids: list[int]) -> master_pb2.GetTaskResponse: ...


@dataclass
class StreamedTask:
    """One task handed to the worker: its ``seq`` in the stream, the task and its records (or why they
    could not be read)."""

    seq: int
    task: master_pb2.Task
    records: Records = field(default_factory=tuple)
    error: Exception | None = None
    #: Seconds the read of its records took (on the stream's thread, overlapping training).
    read_seconds: float = 0.0


class TaskStream:
    """Tasks from the master, ``ahead`` of the one being run (see the module docstring)."""

    def __init__(
        self, master: TaskSource, source: RecordSource, schema: RecordSchema = SERIALIZED, ahead: int = 1
    ) -> None:
        """``schema``: what the training data's records are (the stream's elements after ``seq``)."""
        self._master = master
        self._source = source
        self._schema = schema
        self._ahead = ahead
        self._cond = threading.Condition()
        self._held: dict[int, StreamedTask] = {}
        #: What :meth:`_fetch` has read and :meth:`generate` not yet yielded, in order (None: the end).
        self._fetched: deque[tuple[Any, ...] | None] = deque()
        self._generated = False
        self._seqs = itertools.count()
        self._waiting = False
        self._closed = False
        #: Why the stream ended early (asking the master failed), or None.
        self.failure: BaseException | None = None

    def generate(self) -> Iterator[tuple[Any, ...]]:
        """``(seq, *records)`` per task, and ``(WAIT_SEQ, *no records)`` while the master has none (see the
        module docstring); one generator per stream (a second is a ``RuntimeError``). It never raises for a
        task: a failed read is :attr:`StreamedTask.error`, a failed master call :attr:`failure`.

        The tasks are asked for and read on a thread of the stream's own (:meth:`_fetch`), as soon as the
        worker holds no more than ``ahead`` unfinished tasks: the next task is ready when the pipeline asks
        for it, rather than fetched then (a master call and a ranged read, 3-7 ms on the path from one task's
        last minibatch to the next task's first)."""
        with self._cond:
            if self._generated:
                raise RuntimeError("a task stream is generated once: its tasks are held for one pipeline")
            self._generated = True
        threading.Thread(target=self._fetch, name="task-stream", daemon=True).start()
        while True:
            with self._cond:
                while not self._closed and not self._fetched:
                    self._cond.wait(POLL_SECONDS)
                if self._closed:
                    return
                item = self._fetched.popleft()
            if item is None:
                return
            yield item

    def _fetch(self) -> None:
        """Ask the master for tasks and read them into :attr:`_fetched` (None after the last: the master said
        DONE, or asking failed), while at most ``ahead`` tasks are held besides the one being run, and not
        after a :data:`WAIT_SEQ` until :meth:`resume`."""
        while True:
            with self._cond:
                while not self._closed and (self._waiting or len(self._held) > self._ahead):
                    self._cond.wait(POLL_SECONDS)
                if self._closed:
                    return
                held = [t.task.task_id for t in self._held.values()]
            try:
                response = self._master.get_task(held)
            except Exception as error:  # the worker re-raises it when the stream ends
                self.failure = error
                self._put(None)
                return
            if response.kind == master_pb2.GetTaskResponse.DONE:
                self._put(None)
                return
            if response.kind != master_pb2.GetTaskResponse.TASK:
                with self._cond:
                    self._waiting = True
                self._put((WAIT_SEQ, *self._schema.empty()))
                continue
            streamed = StreamedTask(next(self._seqs), response.task)
            task = response.task
            started = time.perf_counter()
            try:
                streamed.records = self._source.read(task)
            except Exception as error:  # the worker reports the task failed (or the job, if fatal)
                streamed.error = error
            streamed.read_seconds = time.perf_counter() - started
            training = task.type == master_pb2.TRAINING and streamed.error is None
            with self._cond:
                self._held[streamed.seq] = streamed
            self._put((streamed.seq, *(streamed.records if training else self._schema.empty())))

    def _put(self, item: tuple[Any, ...] | None) -> None:
        with self._cond:
            self._fetched.append(item)
            self._cond.notify_all()

    def task(self, seq: int) -> StreamedTask:
        """The task streamed as ``seq`` (until it is :meth:`finished`)."""
        with self._cond:
            return self._held[seq]

    def finished(self, seq: int) -> None:
        """The worker reported task ``seq`` (the master no longer counts it as held): fetch the next."""
        with self._cond:
            self._held.pop(seq, None)
            self._cond.notify_all()

    def resume(self) -> None:
        """The worker acted on a :data:`WAIT_SEQ`: ask the master again."""
        with self._cond:
            self._waiting = False
            self._cond.notify_all()

    def close(self) -> None:
        """End the stream (a generator waiting returns within :data:`POLL_SECONDS`)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
