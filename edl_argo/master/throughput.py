"""Records/s per worker, from the training tasks the master accepts: what the worker scaler decides from
(:mod:`edl_argo.master.worker_scaler`) and what the live metrics show.

A task's records count at the time its report is accepted, for the worker that trained it. Rates are over a
sliding window ending now: ``records in the window / window``. Memory is bounded: samples older than the
longest window asked for so far (at least :data:`KEPT_SECONDS`) are dropped as new ones arrive.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

#: Samples are kept at least this long, whatever windows were asked for.
KEPT_SECONDS = 60.0


class ThroughputMeter:
    """Thread-safe: :meth:`record` from the master's service threads, the rates from anywhere."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, worker, records), oldest first
        self._kept = KEPT_SECONDS
        self._total = 0

    def record(self, worker_id: int, records: int, at: float | None = None) -> None:
        """Worker ``worker_id`` trained ``records`` more records (a training task the master accepted)."""
        now = self._clock() if at is None else at
        with self._lock:
            self._samples.append((now, worker_id, records))
            self._total += records
            while self._samples and self._samples[0][0] < now - self._kept:
                self._samples.popleft()

    @property
    def records_total(self) -> int:
        """Every record counted since the meter was made."""
        with self._lock:
            return self._total

    def records_per_second(self, window_seconds: float, now: float | None = None) -> dict[int, float]:
        """Records/s of each worker that trained records in the last ``window_seconds`` (others absent)."""
        now = self._clock() if now is None else now
        totals: dict[int, int] = {}
        with self._lock:
            self._kept = max(self._kept, window_seconds)
            for at, worker_id, records in reversed(self._samples):
                if at <= now - window_seconds:
                    break
                totals[worker_id] = totals.get(worker_id, 0) + records
        return {worker_id: records / window_seconds for worker_id, records in sorted(totals.items())}

    def total_records_per_second(self, window_seconds: float, now: float | None = None) -> float:
        """The job's records/s over the last ``window_seconds``."""
        return sum(self.records_per_second(window_seconds, now).values())
