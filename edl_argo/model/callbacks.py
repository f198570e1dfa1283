"""``callbacks()`` of a model definition: what of ElasticDL's callbacks edl-argo runs, and where.

ElasticDL's model zoo (at its HEAD) uses one callback: ``LearningRateScheduler(schedule)``, where
``schedule(model_version)`` returns the learning rate of the update that turns ``model_version`` into the
next version. edl-argo applies it where the optimizer runs: each parameter server sets its optimizers'
learning rate to ``schedule(version)`` before every update it applies (its own version), and with
AllreduceStrategy every member does so before every group step (times the world size with
``--scale-lr-by-world-size``). ``optimizer()`` must then have a float learning rate, which the schedule
replaces (a Keras ``LearningRateSchedule`` counts optimizer steps, not model versions).

Any other callback is refused when the model is loaded, naming it: ElasticDL's ``SavedModelExporter`` is
added by ElasticDL's own worker, never by a model file (edl-argo always publishes a SavedModel); its
``MaxStepsStopping`` was removed from ElasticDL (replaced by a ``--max_step`` flag); Keras callbacks
(``tf.keras.callbacks.*``) run inside ``model.fit``, which edl-argo does not use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from edl_argo.errors import ConfigError

#: ``schedule(model_version) -> learning rate``.
Schedule = Callable[[int], float]


class LearningRateScheduler:
    """Sets the learning rate of every update to ``schedule(model_version)`` (ElasticDL's callback of the
    same name: ``from edl_argo.model.callbacks import LearningRateScheduler``)."""

    def __init__(self, schedule: Schedule) -> None:
        if not callable(schedule):
            raise ConfigError(
                f"LearningRateScheduler needs a function of the model version, got {schedule!r}"
            )
        self.schedule = schedule


def learning_rate_schedule(callbacks: Iterable[Any] | None, source: str) -> Schedule | None:
    """The schedule of the one :class:`LearningRateScheduler` among ``callbacks`` (the result of the
    model definition ``source``'s ``callbacks()``), checked to give a finite rate >= 0 at version 0;
    None without one. :class:`ConfigError` names a callback edl-argo does not run."""
    schedulers = []
    for callback in callbacks or ():
        if not isinstance(callback, LearningRateScheduler):
            raise ConfigError(
                f"model definition {source}: callbacks() returned {type(callback).__name__}; edl-argo runs "
                "only edl_argo.model.callbacks.LearningRateScheduler (a learning rate by model version)"
            )
        schedulers.append(callback)
    if len(schedulers) > 1:
        raise ConfigError(f"model definition {source}: callbacks() returned {len(schedulers)} schedulers")
    if not schedulers:
        return None
    schedule = schedulers[0].schedule
    checked_rate(schedule, 0, source=source)
    return schedule


def checked_rate(schedule: Schedule, version: int, *, source: str) -> float:
    """``schedule(version)`` as a float; :class:`ConfigError` unless it is a finite number >= 0."""
    try:
        rate = float(schedule(version))
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"model definition {source}: the LearningRateScheduler's schedule({version}) failed: {error}"
        ) from None
    if not math.isfinite(rate) or rate < 0:
        raise ConfigError(
            f"model definition {source}: the LearningRateScheduler's schedule({version}) is {rate}, "
            "not a learning rate"
        )
    return rate
