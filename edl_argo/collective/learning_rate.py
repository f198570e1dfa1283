"""``--scale-lr-by-world-size``: the linear scaling rule for AllreduceStrategy (the group's batch is one
minibatch per member, so the learning rate is multiplied by the number of members).

:class:`WorldSizeScaling` scales an optimizer whose learning rate is a float (assigned) or a Keras
``LearningRateSchedule`` (wrapped once, before the optimizer step is traced, in a schedule whose factor is a
variable, so the traced step sees every change). Any other learning rate, such as a plain callable, cannot
be scaled: :class:`~edl_argo.errors.ConfigError`, which the master raises before any pod starts
(:func:`check_world_size_scaling`).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from edl_argo.errors import ConfigError
from edl_argo.model.optimizer import OptimizerFactory, has_float_learning_rate, new_optimizer


class WorldSizeScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A model's learning-rate schedule multiplied by ``factor`` (a variable: the group's world size).

    The factor is not part of the group's state: every member sets it from the size of its own round.
    """

    def __init__(
        self, schedule: keras.optimizers.schedules.LearningRateSchedule, factor: tf.Variable
    ) -> None:
        self.schedule = schedule
        self.factor = factor

    def __call__(self, step: Any) -> Any:
        rate = self.schedule(step)
        return rate * tf.cast(self.factor, rate.dtype)

    def get_config(self) -> dict[str, Any]:
        return {"schedule": keras.optimizers.schedules.serialize(self.schedule)}


class WorldSizeScaling:
    """Multiplies ``optimizer``'s learning rate by the world size given to :meth:`set` (1 until then)."""

    def __init__(self, optimizer: keras.optimizers.Optimizer) -> None:
        self._optimizer = optimizer
        self._factor: tf.Variable | None = None
        self._base = 0.0
        self._world_size = 1
        if has_float_learning_rate(optimizer):
            self._base = float(np.asarray(optimizer.learning_rate))
        else:
            self._factor = tf.Variable(1.0, trainable=False, name="world_size")
            optimizer.learning_rate = WorldSizeScaledSchedule(_schedule_of(optimizer), self._factor)

    def set(self, world_size: int) -> float:
        """Scale by ``world_size``; returns the learning rate now in force."""
        self._world_size = world_size
        if self._factor is not None:
            self._factor.assign(float(world_size))
        else:
            self._optimizer.learning_rate = self._base * world_size
        return float(np.asarray(self._optimizer.learning_rate))

    def set_base(self, rate: float) -> None:
        """Make ``rate`` the unscaled float learning rate (the model's ``LearningRateScheduler``), scaled
        by the world size last given to :meth:`set`."""
        if self._factor is not None:
            raise ConfigError("a learning rate by model version needs optimizer() with a float learning_rate")
        self._base = rate
        self._optimizer.learning_rate = rate * self._world_size


def check_world_size_scaling(factory: OptimizerFactory) -> None:
    """:class:`ConfigError` unless the learning rate of the optimizer ``factory`` builds can be scaled."""
    WorldSizeScaling(new_optimizer(factory))


def _schedule_of(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.schedules.LearningRateSchedule:
    """A copy of the schedule the optimizer was given as its ``learning_rate``."""
    try:
        schedule = keras.optimizers.schedules.deserialize(optimizer.get_config()["learning_rate"])
    except (TypeError, ValueError, KeyError, OSError):  # OSError: a lambda's source cannot be read
        schedule = None
    if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        raise ConfigError(
            "--scale-lr-by-world-size needs optimizer() of the model definition with a float learning_rate "
            "or a keras.optimizers.schedules.LearningRateSchedule"
        )
    return schedule
