"""The inventory of a Keras model's state and where each part lives in a ParameterServerStrategy job.

* ``trainable`` (dense variables): on the PS the model's dense layout places them on
  (:class:`~edl_argo.ps.partition.DensePlacement`), big ones in pieces of rows when the optimizer updates
  elementwise (:mod:`edl_argo.ps.pieces`). Gradients are pushed; the PS's Keras optimizer applies
  them, then the variable's constraint; workers pull the values.
* ``non_trainable`` (BatchNormalization statistics, any float variable a layer updates): placed with the
  trainable ones. Every push carries how the worker's forward pass changed them; the PS adds the change
  (the mean over the pushes of a synchronous step, weighted by examples), so no push's change is lost to
  another computed from the same values. The worker undoes its forward pass's
  assignments and pulls the PS's values, so evaluation during training sees what gets exported.
* ``tables`` (Embedding layers): rows on the PS that owns their id; row gradients pushed, rows pulled per
  batch.
* optimizer slots and EMA averages: on the PS, with its optimizer; never sent. At export the EMA averages
  replace the trainable values (``finalize_variable_values``, as at the end of ``fit``).
* the dynamic loss scale of ``LossScaleOptimizer``: on each worker (:mod:`edl_argo.model.train_step`).

Every part a PS holds is in its checkpoints. Non-float non-trainable variables (random seed states,
counters) stay on each worker and are exported as the model built them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import keras
import numpy as np
import tensorflow as tf

from edl_argo.errors import JobFailedError
from edl_argo.model.embedding_tables import EmbeddingTableSpec, embedding_variable_paths, table_specs
from edl_argo.model.packing import PackedLayout
from edl_argo.model.train_step import flat_call, step_function
from edl_argo.rpc.rope import as_tf_tensor

_FLOAT_KINDS = "f"
#: How many sets of variables one model keeps a batched install for (a set is usually all of them).
BATCHED_INSTALL_SETS = 8
#: A set of variables is installed in one call once it has been installed this many times one by one:
#: tracing the call takes about 0.3 s (on 2 cores), which the 2 ms it saves per install repay after
#: 150 steps, and a short job never pays.
BATCHED_INSTALL_AFTER = 50
#: How many sets of variables are counted towards :data:`BATCHED_INSTALL_AFTER` at once; past that (many
#: sets each seen a few times, none repeating), the counts start again, so that they stay bounded.
COUNTED_INSTALL_SETS = 8 * BATCHED_INSTALL_SETS


@dataclass(frozen=True)
class ModelInventory:
    """The parts of one built model's state (see the module docstring), each in a stable order."""

    trainable: tuple[keras.Variable, ...]
    non_trainable: tuple[keras.Variable, ...]
    tables: tuple[EmbeddingTableSpec, ...]
    _batched: _BatchedInstall = field(default_factory=lambda: _BatchedInstall(), compare=False, repr=False)
    #: What :meth:`assign` needs of each variable of :attr:`held_by_ps`, by path (built on its first call).
    _targets: dict[str, _Target] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, model: keras.Model) -> ModelInventory:
        tables = embedding_variable_paths(model)
        return cls(
            trainable=tuple(v for v in model.trainable_variables if v.path not in tables),
            non_trainable=tuple(
                v for v in model.non_trainable_variables if np.dtype(v.dtype).kind in _FLOAT_KINDS
            ),
            tables=tuple(table_specs(model)),
        )

    @property
    def held_by_ps(self) -> tuple[keras.Variable, ...]:
        """The variables a PS holds whole: trainable, then non-trainable."""
        return (*self.trainable, *self.non_trainable)

    def constraints(self) -> dict[str, str]:
        """The constraint of each trainable variable that has one, as JSON, by variable path."""
        return {
            v.path: json.dumps(keras.constraints.serialize(v.constraint))
            for v in self.trainable
            if v.constraint is not None
        }

    @staticmethod
    def values(variables: tuple[keras.Variable, ...]) -> dict[str, np.ndarray]:
        """Copies of ``variables``' values by path."""
        return {v.path: np.array(v.numpy()) for v in variables}

    def assign(self, values: Mapping[str, np.ndarray], complete: bool = False, given: bool = False) -> None:
        """Load PS values into the model; a name the model lacks (or, when ``complete``, a variable the
        PS did not send) is a :class:`JobFailedError`. ``given``: the arrays are the caller's to give away
        (not read or changed afterwards): a variable may keep an array's memory instead of a copy."""
        if not self._targets:
            self._targets.update((v.path, _Target.of(v)) for v in self.held_by_ps)
        targets = self._targets
        unknown = values.keys() - targets.keys()
        if unknown:
            raise JobFailedError(f"the PS holds variables this model lacks: {sorted(unknown)[:3]}")
        missing = targets.keys() - values.keys() if complete else set()
        if missing:
            raise JobFailedError(f"the PS lacks variables of this model: {sorted(missing)[:3]}")
        direct: list[tuple[str, tf.Tensor, np.ndarray]] = []
        for name, value in values.items():
            target = targets[name]
            if target.handle is not None and target.takes(value):
                direct.append((name, target.handle, value))
            else:
                target.variable.assign(value)  # Keras converts and checks
        if direct:
            self._batched.assign(direct, given)


@dataclass(frozen=True)
class _Target:
    """A variable :meth:`ModelInventory.assign` loads: its resource's handle (None when it has none), and
    the dtype and shape of the arrays that can go straight to it. Keras's ``assign`` converts and checks in
    Python, and so did reading these from the variable: most of a small model's install time."""

    variable: keras.Variable
    handle: tf.Tensor | None
    dtype: np.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, variable: keras.Variable) -> _Target:
        handle = getattr(variable.value, "handle", None)
        return cls(variable, handle, np.dtype(variable.dtype), tuple(variable.shape))

    def takes(self, value: object) -> bool:
        """Whether ``value`` can go straight to the resource: an array of the variable's dtype and shape."""
        return isinstance(value, np.ndarray) and value.dtype == self.dtype and value.shape == self.shape


class _BatchedInstall:
    """Assigns values to resource variables in one TensorFlow call, packed (:mod:`edl_argo.model.packing`).

    Each eager assignment costs about 50 microseconds of dispatch (5 ms for a ResNet's 37 variables), one
    packed call 2.8 ms. The call is traced for a set of variables once the set has been installed
    :data:`BATCHED_INSTALL_AFTER` times (a job installs the same set every step), and kept for
    :data:`BATCHED_INSTALL_SETS` sets; other sets are assigned one value at a time.
    """

    def __init__(self) -> None:
        self._calls: dict[tuple[str, ...], tuple[PackedLayout, Callable[..., object]]] = {}
        self._seen: Counter[tuple[str, ...]] = Counter()

    def assign(self, group: list[tuple[str, tf.Tensor, np.ndarray]], given: bool) -> None:
        """``group``: (variable path, resource handle, value of the variable's shape and dtype);
        ``given`` as for :meth:`ModelInventory.assign`."""
        key = tuple(name for name, _, _ in group)
        call = self._calls.get(key)
        if call is None and len(group) > 1 and len(self._calls) < BATCHED_INSTALL_SETS:
            if len(self._seen) >= COUNTED_INSTALL_SETS:
                self._seen.clear()
            self._seen[key] += 1
            if self._seen[key] > BATCHED_INSTALL_AFTER:
                call = self._calls[key] = _packed_assign(group)
                del self._seen[key]
        if call is None:
            for _, handle, value in group:
                _assign_one(handle, value, given)
            return
        layout, assign = call
        assign(*layout.pack([value for _, _, value in group], given))


def _assign_one(handle: tf.Tensor, value: np.ndarray, given: bool) -> None:
    """Assign ``value`` to the resource. TensorFlow may keep a numpy array's memory: one not ``given`` is
    copied first, one given is shared when its memory allows (:func:`~edl_argo.rpc.rope.as_tf_tensor`)."""
    tf.raw_ops.AssignVariableOp(resource=handle, value=as_tf_tensor(value) if given else value.copy())


def _packed_assign(
    group: list[tuple[str, tf.Tensor, np.ndarray]],
) -> tuple[PackedLayout, Callable[..., object]]:
    """The layout of ``group``'s values and a concrete function of its packed tensors that assigns each
    value to its resource."""
    layout = PackedLayout([(value.shape, value.dtype) for _, _, value in group])
    handles = [handle for _, handle, _ in group]

    def assign_all(*packed: tf.Tensor) -> None:
        for handle, value in zip(handles, layout.unpack(packed), strict=True):
            tf.raw_ops.AssignVariableOp(resource=handle, value=value)

    return layout, flat_call(
        step_function(assign_all, input_signature=layout.signature()).get_concrete_function()
    )


def load_constraint(serialized: str) -> keras.constraints.Constraint:
    """A constraint from :meth:`ModelInventory.constraints`' JSON; :class:`ValueError` naming it if Keras
    cannot build it (a custom constraint must be registered by the model file)."""
    try:
        return keras.constraints.get(json.loads(serialized))
    except (ValueError, TypeError) as error:
        raise ValueError(f"unknown Keras constraint {serialized!r}: {error}") from None
