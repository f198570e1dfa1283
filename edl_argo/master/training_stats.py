"""Training loss per epoch, from the mean losses workers report with their training tasks, and the number
of minibatches skipped because their loss was NaN (``--nan-loss skip``) or, per worker, because their
gradients were (``--nan-gradients skip``)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping
from typing import Any


class TrainingLoss:
    """Minibatch-weighted mean training loss of each epoch (only tasks the dispatcher accepted count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[int, float] = defaultdict(float)
        self._steps: dict[int, int] = defaultdict(int)
        self._nan_batches_skipped = 0
        self._nan_gradients_skipped: dict[int, int] = defaultdict(int)

    def add(self, epoch: int, mean_loss: float, steps: int) -> None:
        if steps <= 0:
            return
        with self._lock:
            self._sums[epoch] += mean_loss * steps
            self._steps[epoch] += steps

    def skip_nan_batches(self, count: int) -> None:
        """Count ``count`` minibatches that a worker skipped (no push) because their loss was NaN."""
        if count > 0:
            with self._lock:
                self._nan_batches_skipped += count

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
            return self._nan_batches_skipped

    def per_epoch(self) -> dict[int, float]:
        with self._lock:
            return {epoch: self._sums[epoch] / self._steps[epoch] for epoch in sorted(self._steps)}

    def snapshot(self) -> dict[str, Any]:
        """The sums and step counts per epoch, as JSON data; :meth:`restore` is its inverse."""
        with self._lock:
            return {
                "sums": {str(epoch): total for epoch, total in self._sums.items()},
                "steps": {str(epoch): steps for epoch, steps in self._steps.items()},
                "nan_batches_skipped": self._nan_batches_skipped,
                "nan_gradients_skipped": {str(w): n for w, n in self._nan_gradients_skipped.items()},
            }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Replace the sums and step counts by those of :meth:`snapshot` data (after a master restart)."""
        with self._lock:
            self._sums.clear()
            self._steps.clear()
            self._sums.update({int(e): float(total) for e, total in snapshot["sums"].items()})
            self._steps.update({int(e): int(steps) for e, steps in snapshot["steps"].items()})
            self._nan_batches_skipped = int(snapshot.get("nan_batches_skipped", 0))
            self._nan_gradients_skipped.clear()
            self._nan_gradients_skipped.update(
                {int(w): int(n) for w, n in snapshot.get("nan_gradients_skipped", {}).items()}
            )
