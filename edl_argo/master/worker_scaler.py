"""How many workers a job runs, within ``--min-workers`` .. ``--max-workers``: pause below the minimum, grow
toward the maximum while each worker added pays for itself.

Kept apart from how pods are started and replaced (:mod:`edl_argo.master.pod_manager`) and from task
bookkeeping (:mod:`edl_argo.master.task_dispatcher`). On each tick of the master's main loop,
:meth:`WorkerScaler.tick` reads the pods' :class:`~edl_argo.master.pod_manager.WorkerCounts` and the
workers' measured throughput, and acts through three narrow calls: ``pods.scale_workers(n)``,
``dispatcher.hold_training(held)``, and raising :class:`~edl_argo.errors.JobFailedError`.

The rules:

* **Minimum.** Training tasks go out only while at least ``minimum`` workers run. Below it (at start, until
  enough pods run, or after preemption took workers) training pauses: workers get WAIT, evaluation tasks
  still go out, nothing fails. A pause that lasts ``min_workers_timeout`` fails the job with a line saying
  how many workers ran and how many waited for room.
* **Growth.** While the job wants fewer than ``maximum`` workers, none of its workers waits for room in the
  cluster (Pending), and the current count has been measured, workers are added: one at first, then twice as
  many each time the last ones paid almost fully (a gain of :data:`DOUBLING_GAIN` of a share or more, as a
  slow start), back to one when they paid less. Pods that do not fit stay Pending and block nothing: the job
  trains with those that run, and the cluster places the others when room frees up (preempted workers'
  replacements too).
* **Throughput.** A count of ``n`` workers is *measured* once ``n`` workers run, each of them has reported
  trained records, and that has held for a whole ``window``: its throughput ``T(n)`` is the job's records/s
  over that window. Growth from ``m`` to ``n`` workers goes on only while each worker added raised the
  throughput by at least ``min_gain`` of an average worker's share: ``(T(n) - T(m)) / (n - m) >= min_gain *
  T(m) / m``. Otherwise the parameter servers or the collective are the bottleneck: growth stops (logged
  ``worker_growth_stopped`` with the numbers) and is tried again, one worker, :data:`RETRY_WINDOWS` windows
  later. The workers that did not pay stay: removing them would only cost their start-up again on the next
  try. A count reached otherwise (preemption, a replacement, ``edl-argo scale``) has nothing to be compared
  with: growth from it starts again at one worker.
* **Done.** Once training is over, workers still waiting for room are deleted: they would get no task.

``edl-argo scale`` sets the wanted count directly (:meth:`PodManager.scale_workers`); growth then goes on
from it, up to ``maximum``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from edl_argo.errors import JobFailedError
from edl_argo.log import get_logger
from edl_argo.master.pod_manager import WorkerCounts

log = get_logger(__name__)

#: After growth stopped for lack of gain, it is tried again this many windows later.
RETRY_WINDOWS = 10
#: Workers added that each raised the throughput by at least this much of a worker's share double the next
#: step of growth.
DOUBLING_GAIN = 0.8


class ScaledPods(Protocol):
    """What the scaler needs of :class:`~edl_argo.master.pod_manager.PodManager`."""

    def worker_counts(self) -> WorkerCounts: ...

    def scale_workers(self, count: int) -> int: ...


class HeldDispatcher(Protocol):
    """What the scaler needs of :class:`~edl_argo.master.task_dispatcher.TaskDispatcher`."""

    @property
    def finished(self) -> bool: ...

    def hold_training(self, held: bool) -> None: ...


class Throughput(Protocol):
    """Records/s each worker trained over the last ``window_seconds`` (workers with none are absent)."""

    def records_per_second(self, window_seconds: float, now: float | None = None) -> dict[int, float]: ...


@dataclass(frozen=True)
class WorkerRange:
    """The scaler's settings: ``--min-workers``, ``--max-workers`` and the others of
    :mod:`edl_argo.settings.table` that this module's docstring names."""

    minimum: int
    maximum: int
    min_workers_timeout: float
    window_seconds: float
    min_gain: float

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"worker range {self.minimum}..{self.maximum} is empty or below 1")


@dataclass
class WorkerScaler:
    """Applies the module's rules on each :meth:`tick`; called from the master's main loop only."""

    workers: WorkerRange
    pods: ScaledPods
    dispatcher: HeldDispatcher
    throughput: Throughput
    clock: Callable[[], float] = time.monotonic
    #: T(n): the records/s measured with n workers, the latest measurement of each count.
    measured: dict[int, float] = field(default_factory=dict)
    #: The worker counts over time: ``(seconds since the first tick, running, pending, wanted)`` at each
    #: change, for metrics.json and plots.
    history: list[tuple[float, int, int, int]] = field(default_factory=list)
    paused_seconds: float = 0.0
    workers_added: int = 0
    growth_stops: int = 0
    _first_tick: float | None = None
    _paused_since: float | None = None
    _trained: bool = False
    _trainers: frozenset[int] = frozenset()
    _trainers_since: float = 0.0
    _growth_stopped_until: float = 0.0
    #: The last growth: ``(workers before, workers after)``; what the next decision compares.
    _last_growth: tuple[int, int] | None = None
    _step: int = 1

    def tick(self) -> None:
        """Look at the workers once and act (see the module docstring); JobFailedError when the pause
        below the minimum outlasted its timeout."""
        now = self.clock()
        counts = self.pods.worker_counts()
        self._record(counts, now)
        if self.dispatcher.finished:
            if counts.pending:
                log.info("pending_workers_dropped", workers=counts.pending, reason="training is over")
                self.pods.scale_workers(counts.wanted - counts.pending)
            return
        self._hold_below_minimum(counts, now)
        self._measure(counts, now)
        self._grow(counts, now)

    @property
    def paused(self) -> bool:
        return self._paused_since is not None

    def summary(self) -> dict[str, object]:
        """What metrics.json reports under ``worker_scaling``."""
        return {
            "workers_added": self.workers_added,
            "growth_stops": self.growth_stops,
            "paused_seconds": round(self.paused_seconds, 1),
            "records_per_second_measured": {str(n): round(t, 2) for n, t in sorted(self.measured.items())},
            "worker_counts": [
                [round(t, 1), running, pending, wanted] for t, running, pending, wanted in self.history
            ],
        }

    def _record(self, counts: WorkerCounts, now: float) -> None:
        if self._first_tick is None:
            self._first_tick = now
        seen = (counts.running, counts.pending, counts.wanted)
        if not self.history or self.history[-1][1:] != seen:
            self.history.append((now - self._first_tick, *seen))

    def _hold_below_minimum(self, counts: WorkerCounts, now: float) -> None:
        short = counts.running < self.workers.minimum
        if short and self._paused_since is None:
            self._paused_since = now
            self.dispatcher.hold_training(True)
            # Before training ever started, waiting for workers is the normal start of a job.
            report = log.warning if self._trained else log.info
            report(
                "training_paused" if self._trained else "training_waits_for_workers",
                running=counts.running,
                pending=counts.pending,
                min_workers=self.workers.minimum,
                fails_in_seconds=self.workers.min_workers_timeout,
            )
        elif not short and self._paused_since is not None:
            paused = now - self._paused_since
            if self._trained:
                self.paused_seconds += paused
                log.info("training_resumed", running=counts.running, paused_seconds=round(paused, 1))
            else:
                log.info("training_started", running=counts.running, waited_seconds=round(paused, 1))
            self._trained = True
            self._paused_since = None
            self.dispatcher.hold_training(False)
        elif not short:
            self._trained = True
        if self._paused_since is not None and now - self._paused_since >= self.workers.min_workers_timeout:
            raise JobFailedError(
                f"training paused for {self.workers.min_workers_timeout:.0f} s (--min-workers-timeout) with"
                f" {counts.running} of --min-workers {self.workers.minimum} workers running"
                f" ({counts.pending} waiting for room in the cluster)"
            )

    def _measure(self, counts: WorkerCounts, now: float) -> None:
        """Record T(n) once ``n`` workers have all been training for a whole window."""
        rates = self.throughput.records_per_second(self.workers.window_seconds, now=now)
        trainers = frozenset(worker for worker, rate in rates.items() if rate > 0)
        if trainers != self._trainers:
            self._trainers, self._trainers_since = trainers, now
            return
        settled = len(trainers) == counts.running and not self.paused
        if settled and trainers and now - self._trainers_since >= self.workers.window_seconds:
            self.measured[len(trainers)] = sum(rates.values())

    def _grow(self, counts: WorkerCounts, now: float) -> None:
        n = counts.running
        if (
            counts.wanted >= self.workers.maximum
            or counts.pending
            or n < counts.wanted
            or n not in self.measured
            or now < self._growth_stopped_until
        ):
            return
        retrying = self._growth_stopped_until > 0
        gain = None if retrying else self._gain(n)
        if gain is not None and gain < self.workers.min_gain:
            assert self._last_growth is not None
            before_count = self._last_growth[0]
            self._growth_stopped_until = now + RETRY_WINDOWS * self.workers.window_seconds
            self.growth_stops += 1
            self._last_growth, self._step = None, 1
            log.warning(
                "worker_growth_stopped",
                workers=n,
                workers_before=before_count,
                records_per_second_before=round(self.measured[before_count], 1),
                records_per_second_after=round(self.measured[n], 1),
                gain_of_a_worker_share=round(gain, 3),
                min_gain=self.workers.min_gain,
                why="the parameter servers or the collective limit the throughput, not the workers",
                retry_in_seconds=RETRY_WINDOWS * self.workers.window_seconds,
            )
            return
        self._growth_stopped_until = 0.0
        self._step = self._step * 2 if gain is not None and gain >= DOUBLING_GAIN else 1
        added = min(self._step, self.workers.maximum - counts.wanted)
        target = self.pods.scale_workers(counts.wanted + added)
        self._last_growth = (n, n + added)
        self.workers_added += added
        log.info(
            "workers_added",
            added=added,
            workers=target,
            records_per_second=round(self.measured[n], 1),
            gain_of_a_worker_share=None if gain is None else round(gain, 3),
            retry=retrying,
        )

    def _gain(self, n: int) -> float | None:
        """What each worker of the last growth to ``n`` workers added, as a fraction of an average worker's
        share before it (None: the job did not grow to ``n``, or the count before is not measured)."""
        if self._last_growth is None or self._last_growth[1] != n:
            return None
        before_count = self._last_growth[0]
        before = self.measured.get(before_count)
        if not before:
            return None
        return (self.measured[n] - before) / (n - before_count) / (before / before_count)
