"""Records trained per second, per worker and for the whole job, over a sliding window.

The master calls :meth:`ThroughputMeter.record` once for every training task whose report it accepts (the
servicer's one place for that: :class:`~edl_argo.master.servicer.MasterServicer`), with the task's records.
The live metrics (:mod:`edl_argo.master.metrics`) and the autoscaler read the rates.

**What a rate is.** The records of the tasks reported in the last ``window_seconds`` (a sample at ``at``
counts while ``now - window_seconds < at <= now``), divided by ``window_seconds``. A task counts whole at the
moment it is reported, so a window shorter than a few tasks' duration is noisy, and in the first window of a
job (or of a worker) the rate is below the steady one.

**Memory.** Samples older than the longest window asked for so far (at least ``retention_seconds``) are
dropped whenever the meter is used, and a worker without samples is forgotten: the meter holds
O(workers x tasks reported per window) samples.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable

#: How long samples are kept before any rate is asked for (a longer window asked for keeps them longer).
DEFAULT_RETENTION_SECONDS = 60.0


class ThroughputMeter:
    """Thread-safe record counts over time, by worker; ``clock`` (default :func:`time.monotonic`, never
    going backwards) dates the samples and answers ``now`` when a call gives none."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
    ) -> None:
        if not retention_seconds > 0:
            raise ValueError(f"retention_seconds must be positive, got {retention_seconds}")
        self._clock = clock
        self._lock = threading.Lock()
        self._horizon = float(retention_seconds)
        #: worker id -> (at, records) in ``at`` order.
        self._samples: dict[int, deque[tuple[float, int]]] = {}
        self._total = 0

    def record(self, worker_id: int, records: int, at: float | None = None) -> None:
        """Worker ``worker_id`` completed ``records`` records at ``at`` (default: now). ValueError if
        ``records`` is negative."""
        if records < 0:
            raise ValueError(f"records must be 0 or more, got {records}")
        when = self._clock() if at is None else at
        with self._lock:
            self._total += records
            samples = self._samples.setdefault(worker_id, deque())
            if not samples or samples[-1][0] <= when:
                samples.append((when, records))
            else:  # a late sample (a caller's own ``at``): kept in order
                bisect.insort(samples, (when, records))
            self._prune(worker_id, samples[-1][0])

    @property
    def records_total(self) -> int:
        """Every record counted since the meter was made."""
        with self._lock:
            return self._total

    def records_per_second(self, window_seconds: float, now: float | None = None) -> dict[int, float]:
        """Records per second of each worker that has a sample in the last ``window_seconds`` before
        ``now`` (default: the clock's now); ValueError unless ``window_seconds`` is positive."""
        return self._rates(window_seconds, now)[0]

    def total_records_per_second(self, window_seconds: float, now: float | None = None) -> float:
        """Records per second of all workers together over the last ``window_seconds`` before ``now``
        (default: the clock's now); ValueError unless ``window_seconds`` is positive."""
        return self._rates(window_seconds, now)[1]

    def _rates(self, window_seconds: float, now: float | None) -> tuple[dict[int, float], float]:
        if not window_seconds > 0:
            raise ValueError(f"window_seconds must be positive, got {window_seconds}")
        end = self._clock() if now is None else now
        start = end - window_seconds
        rates: dict[int, float] = {}
        with self._lock:
            self._horizon = max(self._horizon, float(window_seconds))
            for worker_id in list(self._samples):
                self._prune(worker_id, end)
                in_window = [n for at, n in self._samples.get(worker_id, ()) if start < at <= end]
                if in_window:
                    rates[worker_id] = sum(in_window) / window_seconds
        return rates, sum(rates.values())

    def _prune(self, worker_id: int, now: float) -> None:
        """With the lock held: drop the samples of ``worker_id`` older than the horizon before ``now``,
        and the worker when none is left."""
        samples = self._samples[worker_id]
        oldest = now - self._horizon
        while samples and samples[0][0] <= oldest:
            samples.popleft()
        if not samples:
            del self._samples[worker_id]
