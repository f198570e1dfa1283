"""Training loss per epoch, from the mean losses workers report with their training tasks."""

from __future__ import annotations

import threading
from collections import defaultdict


class TrainingLoss:
    """Minibatch-weighted mean training loss of each epoch (only tasks the dispatcher accepted count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[int, float] = defaultdict(float)
        self._steps: dict[int, int] = defaultdict(int)

    def add(self, epoch: int, mean_loss: float, steps: int) -> None:
        if steps <= 0:
            return
        with self._lock:
            self._sums[epoch] += mean_loss * steps
            self._steps[epoch] += steps

    def per_epoch(self) -> dict[int, float]:
        with self._lock:
            return {epoch: self._sums[epoch] / self._steps[epoch] for epoch in sorted(self._steps)}
