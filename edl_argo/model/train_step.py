"""One step of Keras's ``model.fit``, split between the worker and the parameter servers.

``fit`` computes the compiled loss (weighted by ``sample_weight``) plus ``model.losses``, multiplies it by the
optimizer's loss scale, takes the gradients, and ``optimizer.apply`` then: drops variables whose gradient is
None; divides by the loss scale; clips; applies weight decay, the update, EMA and constraints; counts the
iteration (see ``shared/notes/keras-fit-semantics.md``).

The steps that need every gradient of the step run on the worker, which holds them all; a PS holds only its
share of the variables:

* worker (:class:`WorkerSteps`): the loss (:func:`fit_loss`), its scaling (``loss_scale_factor``, or
  ``LossScaleOptimizer``'s dynamic scale, which the worker keeps: a step with a non-finite gradient is not
  pushed and halves it, ``dynamic_growth_steps`` finite steps double it), dropping None gradients, unscaling,
  and ``global_clipnorm`` over all gradients of the step, dense and embedding alike. The norm of an embedding
  table's gradient is taken as Keras takes it, over the rows of every lookup position (an ``IndexedSlices``),
  not over the summed rows;
* parameter server (:func:`ps_optimizer_factory`): the model's optimizer with those steps taken out
  (``LossScaleOptimizer`` unwrapped, ``loss_scale_factor`` and ``global_clipnorm`` cleared), which does
  everything else with Keras's own code: ``clipnorm``/``clipvalue`` per variable, weight decay, the update,
  EMA, constraints (carried by the PS's variables) and the iteration count.

With ``--grads-to-wait K > 1`` each push is clipped on its own before the PS averages K of them (``fit`` has
no such step to compare with).

Every function of a step is traced as ``fit`` traces its own, without AutoGraph (:func:`step_function`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

# What ``compile(loss=fn)`` wraps a loss function in (keras/src/trainers/compile_utils.py); not exported
# under keras.losses.
from keras.src.losses.losses import LossFunctionWrapper

from edl_argo.model.optimizer import OptimizerFactory


def step_function(python_function: Callable[..., Any], **options: Any) -> Any:
    """``tf.function(python_function, **options)``, traced without AutoGraph, as Keras 3's ``fit`` traces its
    train step (``do_not_convert``).

    The model's ``call``, its ``loss`` and the optimizer run as the Python they are: a Python ``if`` or
    ``while`` on a tensor's value fails while tracing, in ``fit`` and here alike (a model writes
    ``tf.cond`` or ``keras.ops.cond``). Converting the step's source would cost a pod a fifth of a second
    before its first step, for a semantics ``fit`` does not have (``docs/profile.md``). A model file's
    ``feed`` is not traced here: tf.data converts its map functions as it does for ``fit``'s input.
    """
    return tf.function(python_function, autograph=False, **options)


def flat_call(concrete: Any) -> Callable[..., Any]:
    """Call ``concrete``, a concrete function of tensors only, without binding the arguments to its
    signature: ``ConcreteFunction.__call__`` binds and checks them in Python, about 0.1 ms a call of a
    few tensors (``docs/profile.md``). The caller passes exactly the signature's tensors, in order, of its
    dtypes and shapes (a packed install, a PS's update): nothing checks them before the kernels run. Where
    TensorFlow's private flat call is missing, the call binds as usual."""
    call_flat = getattr(concrete, "_call_flat", None)
    if call_flat is None:
        return concrete  # type: ignore[no-any-return]

    def call(*tensors: Any) -> Any:
        return call_flat(list(tensors), concrete.captured_inputs)

    return call


#: How many argument signatures a :class:`StepCall` remembers the concrete function of; beyond it, it
#: starts over.
REMEMBERED_SIGNATURES = 32


class StepCall:
    """A step function (:func:`step_function`, ``reduce_retracing``) called through the concrete function
    ``tf.function`` picks for the arguments' dtypes and shapes, remembered by them.

    ``tf.function`` picks that function anew at every call, from the arguments' types: about 0.2 ms of
    Python a call on these machines (``docs/profile.md``), a few percent of a small model's step. Calls
    that leave an argument to its default, and arguments of other kinds than tensors, arrays, numpy
    scalars, None, Python numbers and strings, and lists, tuples and dicts of them (a ``RaggedTensor``,
    say), go through ``tf.function``'s own pick at every call. What runs is the function ``tf.function``
    would have called: it is asked for it (and traces it) the first time a signature comes."""

    def __init__(self, python_function: Callable[..., Any]) -> None:
        self.function = step_function(python_function, reduce_retracing=True)
        self._concrete: dict[Hashable, Any] = {}
        parameters = inspect.signature(python_function).parameters.values()
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        # A concrete function takes every argument: none is left to its default.
        self._arity = len(parameters) if all(p.kind in positional for p in parameters) else -1

    def __call__(self, *args: Any) -> Any:
        key = _signature(args) if len(args) == self._arity else None
        if key is None:
            return self.function(*args)
        concrete = self._concrete.get(key)
        if concrete is None:
            if len(self._concrete) >= REMEMBERED_SIGNATURES:
                self._concrete.clear()
            concrete = self._concrete[key] = self.function.get_concrete_function(*args)
        return concrete(*args)


def _signature(value: Any) -> Hashable | None:
    """What picks the concrete function for ``value`` (an argument, or the tuple of them): dtypes and
    shapes of tensors, Python values themselves, the structure around them; None for anything else."""
    if isinstance(value, tf.Tensor | np.ndarray | np.generic):
        return value.dtype, tuple(value.shape)
    if value is None or isinstance(value, bool | int | float | str):
        return type(value), value
    if isinstance(value, list | tuple):
        items = tuple(_signature(item) for item in value)
        return None if None in items else (type(value), items)
    if isinstance(value, dict):
        entries = tuple((key, _signature(item)) for key, item in value.items())
        return None if any(entry is None for _, entry in entries) else (dict, entries)
    return None


def _inner(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def ps_optimizer_factory(factory: OptimizerFactory) -> OptimizerFactory:
    """``factory``'s optimizer as a PS applies it: without the steps :class:`WorkerSteps` takes.

    Calls that do not return a Keras optimizer are passed through unchanged (the caller reports them).
    """

    def build() -> keras.optimizers.Optimizer:
        optimizer = factory()
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            return optimizer
        optimizer = _inner(optimizer)
        optimizer.loss_scale_factor = None
        optimizer.global_clipnorm = None
        return optimizer

    return build


def fit_loss(
    loss_fn: Callable[[Any, Any], Any],
    labels: Any,
    predictions: Any,
    sample_weight: Any,
    regularization: Sequence[tf.Tensor],
) -> tf.Tensor:
    """The loss ``fit`` minimises for ``compile(loss=loss_fn)``: ``loss_fn``'s values averaged over the batch
    (weighted by ``sample_weight`` as Keras weights them, when given) plus the regularization losses."""
    if sample_weight is not None:
        loss = LossFunctionWrapper(loss_fn)(labels, predictions, sample_weight=sample_weight)
    else:
        loss = tf.convert_to_tensor(loss_fn(labels, predictions))
        if loss.shape.rank:  # values per example: Keras's "sum_over_batch_size"
            loss = tf.reduce_sum(loss) / tf.cast(tf.size(loss), loss.dtype)
    if regularization:
        loss = loss + tf.add_n(list(regularization))
    return loss


class WorkerSteps:
    """The worker's part of the optimizer's step (see the module docstring).

    :meth:`scale_loss` and :meth:`finish` run inside the traced gradient function; :meth:`step_done` after
    the step, on the host, once per step that was applied or skipped.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer) -> None:
        inner = _inner(optimizer)
        self.loss_scale_factor: float | None = inner.loss_scale_factor
        self.global_clipnorm: float | None = inner.global_clipnorm or None
        #: Whether the optimizer keeps EMA averages, which ``fit`` ends with (``use_ema``).
        self.keeps_averages = bool(inner.use_ema)
        self.dynamic = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        self._growth_steps = int(optimizer.dynamic_growth_steps) if self.dynamic else 0
        initial = float(optimizer.initial_scale) if self.dynamic else 1.0
        self._scale = tf.Variable(initial, dtype=tf.float32, trainable=False, name="dynamic_loss_scale")
        self._finite_steps = 0

    @property
    def needs_lookup_gradients(self) -> bool:
        """Whether :meth:`finish` needs the gradient of every embedding lookup position (for the norm)."""
        return self.global_clipnorm is not None

    @property
    def dynamic_scale(self) -> float:
        return float(self._scale.numpy())

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        if self.dynamic:
            return loss * tf.cast(self._scale, loss.dtype)
        if self.loss_scale_factor is not None:
            return loss * self.loss_scale_factor
        return loss

    def finish(
        self, dense: list[tf.Tensor | None], rows: list[tf.Tensor], lookups: list[tf.Tensor]
    ) -> tuple[list[tf.Tensor | None], list[tf.Tensor], tf.Tensor]:
        """Unscale and clip the gradients of the step: ``dense`` per dense variable (None stays None),
        ``rows`` per pulled embedding row, ``lookups`` per lookup position (they only enter the norm, as
        Keras's ``IndexedSlices`` do). Returns the dense and row gradients to push, and whether every
        gradient is finite."""
        present = [g for g in [*dense, *rows, *lookups] if g is not None]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in present]) if present else True
        scale: Any = self._scale if self.dynamic else self.loss_scale_factor
        if scale is not None:
            dense = [None if g is None else g / tf.cast(scale, g.dtype) for g in dense]
            rows = [g / tf.cast(scale, g.dtype) for g in rows]
            lookups = [g / tf.cast(scale, g.dtype) for g in lookups]
        if self.global_clipnorm is not None:
            # Keras's clip_by_global_norm (keras/src/optimizers/base_optimizer.py) over the whole step.
            squares = [tf.reduce_sum(tf.square(g)) for g in [*dense, *lookups] if g is not None]
            norm = tf.sqrt(tf.reduce_sum(tf.stack(squares)))
            clip = self.global_clipnorm
            factor = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
            dense = [None if g is None else g * tf.cast(factor, g.dtype) for g in dense]
            rows = [g * tf.cast(factor, g.dtype) for g in rows]
        return dense, rows, finite

    def step_done(self, finite: bool) -> None:
        """Advance the dynamic loss scale as ``LossScaleOptimizer`` does after a step."""
        if not self.dynamic:
            return
        if not finite:
            self._finite_steps = 0
            self._scale.assign(self._scale * 0.5)
        elif self._finite_steps == self._growth_steps - 1:
            self._finite_steps = 0
            self._scale.assign(self._scale * 2.0)
        else:
            self._finite_steps += 1
