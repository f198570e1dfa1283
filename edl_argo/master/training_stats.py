"""Training loss per epoch, from the mean losses workers report with their training tasks, and the number
of minibatches skipped because their loss was NaN (``--nan-loss skip``), because their scaled gradients
overflowed under ``LossScaleOptimizer``'s dynamic scale (as ``fit`` skips them) or, per worker, because their
gradients were not finite (``--nan-gradients skip``)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TrainingReport:
    """A training task report the master accepted: what the worker ``worker_id`` trained of ``epoch``
    (``records`` records in ``steps`` minibatches, at ``mean_loss``) and the model version it reported
    after its last minibatch."""

    worker_id: int
    epoch: int
    records: int
    steps: int
    mean_loss: float
    model_version: int


#: Task report counters of skipped minibatches counted as job totals.
SKIPPED_TOTALS = ("nan_batches_skipped", "loss_scale_skipped")


class TrainingLoss:
    """Minibatch-weighted mean training loss of each epoch (only tasks the dispatcher accepted count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[int, float] = defaultdict(float)
        self._steps: dict[int, int] = defaultdict(int)
        #: Totals of the task report counters in :data:`SKIPPED_TOTALS`.
        self._skipped = dict.fromkeys(SKIPPED_TOTALS, 0)
        self._nan_gradients_skipped: dict[int, int] = defaultdict(int)
        self._latest: float | None = None

    def add(self, epoch: int, mean_loss: float, steps: int) -> None:
        """Count a task's ``steps`` minibatches of ``epoch`` at ``mean_loss`` (none: nothing counts)."""
        if steps <= 0:
            return
        with self._lock:
            self._sums[epoch] += mean_loss * steps
            self._steps[epoch] += steps
            self._latest = mean_loss

    @property
    def latest(self) -> float | None:
        """The mean loss of the task counted last by this master (not saved: None after a restart until a
        task is counted)."""
        with self._lock:
            return self._latest

    def add_skipped(self, counters: Mapping[str, int]) -> None:
        """Count the minibatches a task report's ``counters`` say were skipped (nothing pushed): NaN losses
        (``nan_batches_skipped``), loss-scale overflows (``loss_scale_skipped``)."""
        with self._lock:
            for name in SKIPPED_TOTALS:
                self._skipped[name] += max(0, counters.get(name, 0))

    def skip_nan_gradients(self, worker_id: int, count: int) -> None:
        """Count ``count`` minibatches worker ``worker_id`` skipped: their gradients were not finite."""
        if count > 0:
            with self._lock:
                self._nan_gradients_skipped[worker_id] += count

    @property
    def nan_gradients_skipped(self) -> dict[str, int]:
        """Minibatches skipped for non-finite gradients, by worker id (as text, for JSON)."""
        with self._lock:
            return {str(worker): n for worker, n in sorted(self._nan_gradients_skipped.items())}

    @property
    def nan_batches_skipped(self) -> int:
        with self._lock:
            return self._skipped["nan_batches_skipped"]

    @property
    def loss_scale_skipped(self) -> int:
        """Minibatches whose step the dynamic loss scale skipped (their scaled gradients overflowed)."""
        with self._lock:
            return self._skipped["loss_scale_skipped"]

    def per_epoch(self) -> dict[int, float]:
        with self._lock:
            return {epoch: self._sums[epoch] / self._steps[epoch] for epoch in sorted(self._steps)}

    def snapshot(self) -> dict[str, Any]:
        """The sums and step counts per epoch, as JSON data; :meth:`restore` is its inverse."""
        with self._lock:
            return {
                "sums": {str(epoch): total for epoch, total in self._sums.items()},
                "steps": {str(epoch): steps for epoch, steps in self._steps.items()},
                **self._skipped,
                "nan_gradients_skipped": {str(w): n for w, n in self._nan_gradients_skipped.items()},
            }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Replace the sums and step counts by those of :meth:`snapshot` data (after a master restart)."""
        with self._lock:
            self._sums.clear()
            self._steps.clear()
            self._sums.update({int(e): float(total) for e, total in snapshot["sums"].items()})
            self._steps.update({int(e): int(steps) for e, steps in snapshot["steps"].items()})
            self._skipped = {name: int(snapshot.get(name, 0)) for name in SKIPPED_TOTALS}
            self._nan_gradients_skipped.clear()
            self._nan_gradients_skipped.update(
                {int(w): int(n) for w, n in snapshot.get("nan_gradients_skipped", {}).items()}
            )
