"""Names a model file uses: the ``mode`` passed to ``feed`` and the prediction-outputs base class."""

from __future__ import annotations

import abc
from typing import Any


class Mode:
    """The ``mode`` argument of ``feed``: what the records are being read for."""

    TRAINING = "training"
    EVALUATION = "evaluation"
    PREDICTION = "prediction"


class BasePredictionOutputsProcessor(abc.ABC):
    """Receives the model's outputs for each prediction task a worker runs.

    A model file may define a subclass named ``PredictionOutputsProcessor``; without one, predictions are
    written to the job's output location.
    """

    @abc.abstractmethod
    def process(self, predictions: Any, worker_id: int) -> None:
        """Handle the outputs of one batch (a numpy array, or a dict of them for multi-output models)."""
