"""Build the model definition's optimizer and ask what its learning rate is.

Every role builds optimizers from the model definition's ``optimizer()``: the master checks it before any
pod starts, the PS applies gradients with it (:mod:`edl_argo.ps.optimizer`), AllreduceStrategy scales its
learning rate (:mod:`edl_argo.collective.learning_rate`).
"""

from __future__ import annotations

from collections.abc import Callable

import keras

from edl_argo.errors import ConfigError

#: Builds a fresh Keras optimizer: the model definition's ``optimizer()``.
OptimizerFactory = Callable[[], keras.optimizers.Optimizer]


def new_optimizer(factory: OptimizerFactory) -> keras.optimizers.Optimizer:
    """Call ``factory`` and check it returned a Keras optimizer (:class:`ConfigError` otherwise)."""
    optimizer = factory()
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(
            f"optimizer() of the model definition returned {type(optimizer).__name__}, "
            "not a keras.optimizers.Optimizer"
        )
    return optimizer


def has_float_learning_rate(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether the learning rate is a float (a variable that can be scaled), not a schedule or callable."""
    return isinstance(optimizer.learning_rate, keras.Variable)
