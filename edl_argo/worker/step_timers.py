"""Where a worker's main thread spends its time: waiting for input, computing, talking to the parameter
servers or the peers, coordinating with the master.

One process-wide :data:`STEP_TIMERS`, bound to the thread that runs the task loop (:meth:`StepTimers.bind`);
sections entered on any other thread (a PS client's pool, a background push) are not counted, so the
totals add up to the main thread's wall time. Sections nest and time is *exclusive*: a PS pull inside a
training step counts as ``ps``, not also as ``compute``. Time outside every section is ``other`` (the task
loop itself: reading counters, logging, the backoff sleep while the master has no task). The cost is two
``time.perf_counter()`` calls per section.

Listeners (:meth:`StepTimers.listen`) learn each section the bound thread enters or returns to: the input
prefetcher (:mod:`edl_argo.worker.input_prefetch`) works only while that thread does not compute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: The sections: the next minibatch from the input pipeline; the model's forward and backward pass and
#: applying gradients; calls to the parameter servers; collective calls among peers; calls to the master.
SECTIONS = ("input", "compute", "ps", "peers", "master")
OTHER = "other"


class StepTimers:
    """Exclusive wall time per section of one thread (see the module docstring)."""

    def __init__(self) -> None:
        self._thread: int | None = None
        self._totals = dict.fromkeys((*SECTIONS, OTHER), 0.0)
        self._stack: list[str] = []
        self._mark = time.perf_counter()
        self._listeners: list[Callable[[str], None]] = []

    def bind(self) -> None:
        """Count the sections of the calling thread from now on (and start over)."""
        self._thread = threading.get_ident()
        self._totals = dict.fromkeys(self._totals, 0.0)
        self._stack = []
        self._mark = time.perf_counter()

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Count the time inside the block as ``name`` (one of :data:`SECTIONS`)."""
        if threading.get_ident() != self._thread:
            yield
            return
        self._charge()
        self._stack.append(name)
        self._tell(name)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()
            self._tell(self.current)

    def listen(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call ``listener(section)`` on the bound thread each time it enters a section or leaves one, with
        the section it is in now (:data:`OTHER` outside every section); it must return at once. Returns the
        function that stops the calls."""
        self._listeners = [*self._listeners, listener]

        def stop() -> None:
            self._listeners = [other for other in self._listeners if other is not listener]

        return stop

    @property
    def current(self) -> str:
        """The section the bound thread is in now (:data:`OTHER` outside every section)."""
        stack = self._stack
        return stack[-1] if stack else OTHER

    def totals(self) -> dict[str, float]:
        """Seconds per section (and ``other``) since :meth:`bind`, up to now."""
        if self._thread is not None and threading.get_ident() == self._thread:
            self._charge()
        return dict(self._totals)

    def _tell(self, section: str) -> None:
        for listener in self._listeners:
            listener(section)

    def _charge(self) -> None:
        now = time.perf_counter()
        self._totals[self._stack[-1] if self._stack else OTHER] += now - self._mark
        self._mark = now


#: The worker process's timers.
STEP_TIMERS = StepTimers()


def as_counters(since: dict[str, float], now: dict[str, float]) -> dict[str, int]:
    """The time between two :meth:`StepTimers.totals` as task-report counters: ``time_<section>_us``."""
    return {f"time_{name}_us": max(0, int((now[name] - since.get(name, 0.0)) * 1e6)) for name in now}
