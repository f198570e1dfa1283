"""Build the model definition's optimizer and ask what its learning rate is.

Every role builds optimizers from the model definition's ``optimizer()``: the master checks it before any
pod starts, the PS applies gradients with it (:mod:`edl_argo.ps.optimizer`), AllreduceStrategy scales its
learning rate (:mod:`edl_argo.collective.learning_rate`), the workers ask whether its update is elementwise
(:func:`updates_elementwise`: may a variable be cut into pieces on several PS, :mod:`edl_argo.ps.pieces`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras

from edl_argo.errors import ConfigError
from edl_argo.model.user_code import ModelError

#: Builds a fresh Keras optimizer: the model definition's ``optimizer()``.
OptimizerFactory = Callable[[], keras.optimizers.Optimizer]


def new_optimizer(factory: OptimizerFactory) -> keras.optimizers.Optimizer:
    """Call ``factory`` and check it returned a Keras optimizer (:class:`ConfigError` otherwise)."""
    optimizer = factory()
    if wrong := _not_an_optimizer(optimizer):
        raise ConfigError(f"optimizer() of the model definition {wrong}")
    return optimizer


def model_optimizer_factory(function: Callable[[], Any], source: str, name: str) -> OptimizerFactory:
    """``function``, the optimizer function of model file ``source`` (named ``name`` there), checked each
    time it is called to return a Keras optimizer: otherwise :class:`ConfigError` names the file and the
    function, as a :class:`~edl_argo.model.user_code.ModelError` does."""

    @functools.wraps(function)
    def build() -> keras.optimizers.Optimizer:
        optimizer = function()
        if wrong := _not_an_optimizer(optimizer):
            raise ConfigError(str(ModelError(source, name, wrong)))
        return optimizer

    return build


def _not_an_optimizer(value: Any) -> str:
    """What is wrong with ``value`` as what an optimizer function returned; empty if it is an optimizer."""
    if isinstance(value, keras.optimizers.Optimizer):
        return ""
    return f"returned {type(value).__name__}, not a keras.optimizers.Optimizer"


#: The Keras optimizers whose update of a variable is elementwise: each element's new value and slots
#: depend on that element's value, gradient and slots and on scalars alone (the iteration count, the
#: learning rate, Nadam's momentum product). Checked in keras/src/optimizers/ (Keras 3): momentum and
#: Nesterov, AMSGrad, centred RMSprop, Ftrl's shrinkage, and the base class's weight decay, ``clipvalue``,
#: EMA and gradient accumulation are elementwise too. Lamb (trust ratio: norms of the variable and its
#: update), Adafactor (moments factored over rows and columns), Muon (orthogonalised matrices) and any other
#: class are not taken to be.
ELEMENTWISE_OPTIMIZERS: tuple[type[keras.optimizers.Optimizer], ...] = (
    keras.optimizers.SGD,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.Adamax,
    keras.optimizers.Nadam,
    keras.optimizers.RMSprop,
    keras.optimizers.Adagrad,
    keras.optimizers.Adadelta,
    keras.optimizers.Ftrl,
    keras.optimizers.Lion,
)


def updates_elementwise(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether ``optimizer`` (as a PS applies it: ``global_clipnorm`` and loss scaling taken out, see
    :func:`edl_argo.model.train_step.ps_optimizer_factory`) updates every element of a variable on its own,
    so that updating row ranges of a variable as variables of their own is updating the variable.

    True only for exactly a class of :data:`ELEMENTWISE_OPTIMIZERS` (a subclass may change the update)
    without ``clipnorm`` (a norm per variable) and without weight decay exclusions by name (a piece is named
    otherwise than its variable).
    """
    return (
        type(optimizer) in ELEMENTWISE_OPTIMIZERS
        and not optimizer.clipnorm
        and not optimizer.global_clipnorm
        and getattr(optimizer, "_exclude_from_weight_decay_pattern", None) is None
    )


def has_float_learning_rate(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether the learning rate is a float (a variable that can be scaled), not a schedule or callable."""
    return isinstance(optimizer.learning_rate, keras.Variable)
