"""The training input, prepared ahead while the training thread waits for another process, never while it
computes.

A training step's compute (TensorFlow's kernels) already runs on every core: TensorFlow sizes its intra-op
pool to the machine. An input pipeline that runs ahead on threads of its own (tf.data's ``prefetch``) takes
its cores from that compute, and a kernel split across the pool waits for its slowest part. Yet a step also
waits: for the parameter servers' reply, for its peers' collective, for the master.
:class:`WaitTimePrefetcher` prepares the next minibatches during those waits, so that the step neither
computes beside its input nor waits for it (measured: ``docs/benchmarks.md``).

The training thread's sections come from :data:`~edl_argo.worker.step_timers.STEP_TIMERS`; the waits are
:data:`WAITS`. Preparing an element is not interrupted, so one begun late in a wait may overlap the compute
after it. When the training thread asks for an element that is not ready, the prefetcher works for it at
once, whatever the section. A step that does not wait (one AllreduceStrategy worker, asynchronous pushes in
the background) has no such time: after one, the input is prepared beside the compute, as tf.data's
``prefetch`` would.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from edl_argo.log import get_logger
from edl_argo.worker.step_timers import StepTimers

log = get_logger(__name__)

T = TypeVar("T")

#: The sections of the training thread that wait for another process: the prefetcher works during them.
WAITS = frozenset({"ps", "peers", "master"})
#: How long :meth:`WaitTimePrefetcher.close` waits for the prefetch thread to end.
CLOSE_SECONDS = 5.0
#: How often a consumer waiting for an element checks that the prefetch thread is still alive (and the
#: idle prefetch thread that it is not closed).
LIVENESS_SECONDS = 1.0


@dataclass(frozen=True)
class _Raised:
    """An error the pipeline raised in place of an element: raised to the consumer in its turn."""

    error: Exception


_END = object()


class WaitTimePrefetcher(Generic[T]):
    """Iterates ``elements`` on a thread of its own, at most ``depth`` elements ahead of the consumer, and
    only while the thread ``timers`` is bound to waits (:data:`WAITS`) or asks for the next element, unless
    its last step did not wait at all (see the module docstring).

    What the consumer receives is exactly what iterating ``elements`` gives, in order: its elements, then
    the end; an exception ``elements`` raises is raised to the consumer in its place, and iterating goes on
    after it (as a tf.data iterator does after an error in one element's map).
    """

    def __init__(self, elements: Iterator[T], depth: int, timers: StepTimers, name: str = "input-prefetch"):
        if depth < 1:
            raise ValueError(f"prefetch depth {depth}: at least 1")
        self._elements = elements
        self._depth = depth
        self._changed = threading.Condition()
        self._ready: deque[object] = deque()
        self._waiting = timers.current in WAITS
        self._waited = False  # whether the training thread waited since it took its last element
        self._steps_wait = False  # whether it had, between its last two elements
        self._wanted = False
        self._closed = False
        self._stop_listening = timers.listen(self._on_section)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __iter__(self) -> WaitTimePrefetcher[T]:
        return self

    def __next__(self) -> T:
        """The next element (waiting for it), :class:`StopIteration` at the end, or the pipeline's error."""
        with self._changed:
            self._wanted = True
            self._changed.notify_all()
            try:
                while not self._ready:
                    if not self._thread.is_alive():
                        raise RuntimeError("the input prefetch thread ended before the input did")
                    self._changed.wait(LIVENESS_SECONDS)
            finally:
                self._wanted = False
            element = self._ready[0]
            if element is _END:
                raise StopIteration
            self._ready.popleft()
            self._steps_wait, self._waited = self._waited, self._waiting
            self._changed.notify_all()
        if isinstance(element, _Raised):
            raise element.error
        return element  # type: ignore[return-value]

    def close(self) -> None:
        """Stop preparing elements; wait up to :data:`CLOSE_SECONDS` for the thread (it may be inside the
        pipeline, which ends when its source does)."""
        self._stop_listening()
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(CLOSE_SECONDS)
        if self._thread.is_alive():
            log.warning("input_prefetch_not_stopped", seconds=CLOSE_SECONDS)

    def _on_section(self, section: str) -> None:
        waiting = section in WAITS
        if waiting == self._waiting:
            return
        with self._changed:
            self._waiting = waiting
            self._waited = self._waited or waiting
            self._changed.notify_all()

    def _may_work(self) -> bool:
        return len(self._ready) < self._depth and (self._wanted or self._waiting or not self._steps_wait)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._closed and not self._may_work():
                    self._changed.wait(LIVENESS_SECONDS)
                if self._closed:
                    return
            element: object
            try:
                element = next(self._elements)
            except StopIteration:
                element = _END
            except Exception as error:  # feed's, or a reader's: the consumer's to handle
                element = _Raised(error)
            with self._changed:
                self._ready.append(element)
                self._changed.notify_all()
            if element is _END:
                return
