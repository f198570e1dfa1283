"""Task reports sent to the master off the worker's main thread, in the order they were made.

The master answers a task report only once it has saved the change (:mod:`edl_argo.master.state_store`):
one or two state writes, which a worker that reported on its main thread waited for between two tasks.
:class:`TaskReporter` sends them from a thread of its own while the main thread trains the next task.

The contract:

* Reports are sent one at a time, in the order :meth:`TaskReporter.send` was called, each with the master
  client's own retries and deadline. A task is handed over only after its last minibatch was applied, so
  "reported done" still means "trained"; it is merely told later.
* ``sent`` (given with each report) runs on the reporter's thread once the master accepted that report:
  the worker's task stream then stops counting the task as held (:meth:`~edl_argo.worker.task_stream.
  TaskStream.finished`), so at most one report is pending while the stream reads ahead.
* When a report cannot be sent (the master client gave up), later reports are dropped, ``on_failure`` runs
  once (the worker closes its task stream, so its main loop ends), and :meth:`TaskReporter.close` raises
  that error on the main thread. A worker that dies with a report pending loses nothing the master does not
  already handle: like every task of a dead worker, the task is requeued when its pod ends.
* :meth:`TaskReporter.close` waits until every report was sent (at most ``close_seconds``, beyond which a
  report still pending is abandoned and the master's own task timeout requeues it).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from edl_argo.log import get_logger

log = get_logger(__name__)

#: How long :meth:`TaskReporter.close` waits for pending reports at most (a report is retried by the
#: master client within its own budget; this only bounds the wait of a worker that is ending).
CLOSE_SECONDS = 600.0

Report = Callable[[], Any]


class TaskReporter:
    """Sends task reports on a thread of its own (see the module docstring)."""

    def __init__(self, on_failure: Callable[[], None] = lambda: None, close_seconds: float = CLOSE_SECONDS):
        self._on_failure = on_failure
        self._close_seconds = close_seconds
        # (report, sent) in order; a report of None marks a flush (its callback always runs); None stops.
        self._queue: queue.Queue[tuple[Report | None, Callable[[], None]] | None] = queue.Queue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="task-reporter", daemon=True)
        self._thread.start()

    @property
    def failure(self) -> BaseException | None:
        """Why reports stopped being sent, or None."""
        return self._failure

    def send(self, report: Report, sent: Callable[[], None] = lambda: None) -> None:
        """Queue ``report()`` (a master call); ``sent()`` runs once it returned. Raises the error that
        stopped the reporter, if one did."""
        self._raise_failure()
        self._queue.put((report, sent))

    def flush(self) -> None:
        """Wait until every report queued so far was sent (at most ``close_seconds``); raise the error
        that stopped the reporter, if one did."""
        done = threading.Event()
        self._queue.put((None, done.set))
        if not done.wait(self._close_seconds) and self._failure is None:
            raise TimeoutError(f"task reports were not sent within {self._close_seconds:.0f} s")
        self._raise_failure()

    def close(self, raise_failure: bool = True) -> None:
        """Send what is queued and stop the thread; then raise the error that stopped the reporter, if one
        did and ``raise_failure``. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(self._close_seconds)
            if self._thread.is_alive():
                log.warning(
                    "task_reports_abandoned", pending=self._queue.qsize(), waited_s=self._close_seconds
                )
        if raise_failure:
            self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            report, sent = item
            if report is None:
                sent()
                continue
            if self._failure is not None:
                continue  # dropped: the worker is ending with the first failure
            try:
                report()
            except BaseException as error:  # raised on the main thread by send, flush or close
                self._failure = error
                self._on_failure()
                continue
            sent()
