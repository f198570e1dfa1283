"""A thread-safe event queue: the shared plumbing behind :meth:`PodBackend.events`.

Backend threads (a process waiter, a Kubernetes watch) :meth:`~EventQueue.put` events; the master
:meth:`~EventQueue.take` s them in batches. Not part of the master's interface.
"""

from __future__ import annotations

import threading
from collections import deque

from edl_argo.pods.base import PodEvent


class EventQueue:
    """An unbounded FIFO of :class:`PodEvent` whose consumer takes everything queued at once."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._events: deque[PodEvent] = deque()
        self._closed = False

    def put(self, event: PodEvent) -> None:
        """Append one event and wake a waiting :meth:`take`. Allowed after :meth:`close`."""
        with self._ready:
            self._events.append(event)
            self._ready.notify_all()

    def take(self, timeout: float | None) -> list[PodEvent]:
        """Remove and return all queued events, oldest first.

        When none are queued, waits up to ``timeout`` seconds (``None``: without limit) for one, unless
        the queue is closed; may return ``[]``.
        """
        with self._ready:
            if not self._events and not self._closed and (timeout is None or timeout > 0):
                self._ready.wait_for(lambda: self._events or self._closed, timeout)
            events = list(self._events)
            self._events.clear()
            return events

    def close(self) -> None:
        """From now on :meth:`take` never waits; wake any that does."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
