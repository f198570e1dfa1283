"""Per-step time breakdown of our workers' main threads, from the timers in the worker.

Every training-task report carries the worker main thread's time per section since its previous report
(``time_<section>_us``, :mod:`edl_argo.worker.step_timers`: exclusive wall time measured with
``time.perf_counter()``). :class:`CountersTap` stands in for a job's ledger and keeps those counters per
task; :func:`breakdown_note` sums them over the tasks of the timed windows.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from edl_argo.worker.main import READ_COUNTER
from edl_argo.worker.step_timers import OTHER, SECTIONS

LABELS = {
    "input": "input wait",
    "compute": "compute",
    "ps": "PS calls",
    "peers": "peers (allreduce)",
    "master": "master calls",
    OTHER: "other (task loop)",
}


class CountersTap:
    """Stands in for a job's :class:`~edl_argo.master.ledger.TrainingLedger`: everything passes through, and
    the time counters of every accepted training report (and the read time, ``read_us``) are kept by task
    id."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.times: dict[int, dict[str, int]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def add(self, task: Any, counters: Mapping[str, int], *args: Any, **kwargs: Any) -> None:
        self._inner.add(task, counters, *args, **kwargs)
        with self._lock:
            self.times[task.task_id] = {
                k: v for k, v in counters.items() if k.startswith("time_") or k == READ_COUNTER
            }


def breakdown(tap: CountersTap, task_ids: Iterable[int], steps: int) -> dict[str, float]:
    """Milliseconds per step of every section over ``task_ids`` (that trained ``steps`` minibatches)."""
    totals = dict.fromkeys((*SECTIONS, OTHER), 0.0)
    for task_id in task_ids:
        for name, micros in tap.times.get(task_id, {}).items():
            section = name.removeprefix("time_").removesuffix("_us")
            if section in totals:
                totals[section] += micros / 1000.0
    return {name: total / max(1, steps) for name, total in totals.items()}


def breakdown_note(label: str, per_step: dict[str, float]) -> str:
    """One line: ms per step and share of each section that took any time."""
    total = sum(per_step.values()) or 1.0
    parts = [
        f"{LABELS[name]} {ms:.1f} ms ({100 * ms / total:.0f}%)" for name, ms in per_step.items() if ms >= 0.05
    ]
    return (
        f"{label}, worker main thread per step in the timed windows ({total:.1f} ms; timers in the worker, "
        f"summed from its task reports): " + ", ".join(parts) + "."
    )


def read_ms_per_step(tap: CountersTap, task_ids: Iterable[int], steps: int) -> float:
    """Milliseconds per step the workers' task streams spent reading records (on their own thread, one
    task ahead of training: time the input pipeline can hide) over ``task_ids``."""
    total = sum(tap.times.get(task_id, {}).get(READ_COUNTER, 0) for task_id in task_ids)
    return total / 1000.0 / max(1, steps)
