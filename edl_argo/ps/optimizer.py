"""Apply gradients on a parameter server with Keras's own optimizers.

No update rule is re-implemented here: every update is computed by ``apply_gradients`` of a Keras optimizer
built from the model definition's ``optimizer()``.

* :class:`DenseOptimizer`: one optimizer instance over the server's dense variables, which it holds (the
  small ones packed into one flat variable per dtype when the update is elementwise).
* :class:`SparseOptimizer`: one optimizer instance per group of embedding tables of one row width. Keras 3
  turns an ``IndexedSlices`` gradient into an update of the whole table (and of every slot), so instead the
  optimizer is built on a fixed-size *staging* variable. For each push, the touched rows and their slot rows
  are gathered from the :class:`~edl_argo.ps.embedding_table.EmbeddingTable` into the staging variable and
  its slot variables, the optimizer applies a dense gradient to the staging variable, and the updated rows
  and slot rows are scattered back. Rows beyond the pushed ones (padding up to the staging capacity) hold
  zeros with fresh slot values and get zero gradients; they are discarded. The capacity grows to the next
  power of two a push needs and shrinks back after :data:`SHRINK_AFTER_APPLIES` pushes in a row needed a
  quarter of it or less. Gradient rows of a repeated id
  are summed first, which makes the gradient exactly the dense gradient of those rows. (Keras 3's Adam fed
  an ``IndexedSlices`` with repeated indices squares each repeat before summing for its second moment, which
  is not the square of the gradient.)

Assumptions of the sparse path, checked when a table's optimizer is built:

* The optimizer's per-variable state is *elementwise*: every variable ``build()`` creates for the staging
  variable either has the staging variable's shape (a slot: row ``i`` of the slot belongs to row ``i`` of
  the variable) or is a scalar. SGD (with momentum), Adam, AdamW, Adamax, Nadam, Adagrad, Adadelta,
  RMSprop, Ftrl, Lion and Lamb qualify; Adafactor's factored state does not and is rejected.
* Slots are created with a constant initializer (zeros for most optimizers, ``initial_accumulator_value``
  for Adagrad), so one initial row describes every fresh slot row.
* Per-variable norms (Lamb's trust ratio, ``clipnorm``) see only the pushed rows: the update of rows ``R``
  equals what the optimizer computes for a variable that holds exactly rows ``R`` with the same slot
  state and iteration count. The padding's zero rows do not change those norms.
* The scalar state (``iterations``, ...) is per group of tables: it counts the pushes that touched the
  group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from edl_argo.errors import ConfigError
from edl_argo.log import get_logger
from edl_argo.model.optimizer import (
    OptimizerFactory,
    has_float_learning_rate,
    new_optimizer,
    updates_elementwise,
)
from edl_argo.model.train_step import flat_call, step_function
from edl_argo.ps.embedding_table import EmbeddingTable
from edl_argo.rpc.packed import group_small
from edl_argo.rpc.rope import as_tf_tensor

log = get_logger(__name__)

_MIN_STAGING_ROWS = 64
#: The staging capacity shrinks back once this many applies in a row each needed at most a quarter of it
#: (one huge push must not pad every later push to its size).
SHRINK_AFTER_APPLIES = 16


class LearningRateScaleError(ValueError):
    """A learning-rate scale other than 1 was asked of an optimizer whose learning rate is not a float."""


def check_optimizer_factory(factory: OptimizerFactory, scale_learning_rate: bool) -> None:
    """Fail fast at startup with a :class:`ConfigError` unless ``factory`` builds a Keras optimizer that
    the sparse path supports (see the module's assumptions), with a float learning rate when
    ``scale_learning_rate`` (a learning-rate schedule cannot be scaled)."""
    SparseOptimizer(factory, EmbeddingTable("check", 1, "zeros"), capacity=1)
    optimizer = new_optimizer(factory)
    if scale_learning_rate and not has_float_learning_rate(optimizer):
        raise ConfigError(
            f"the model's {type(optimizer).__name__} uses a learning-rate schedule, which cannot be scaled "
            "(--lr-staleness-modulation); give optimizer() a float learning_rate"
        )


class _KerasOptimizer:
    """A Keras optimizer plus a learning rate that can be scaled for one apply."""

    def __init__(self, factory: OptimizerFactory) -> None:
        self._factory = factory
        self.optimizer = new_optimizer(factory)

    def set_learning_rate(self, rate: float) -> None:
        """Make ``rate`` the (float) learning rate of the following applies."""
        if not has_float_learning_rate(self.optimizer):
            raise LearningRateScaleError(
                f"learning rate {rate:g} asked, but the model's {type(self.optimizer).__name__} uses a "
                "learning-rate schedule"
            )
        self.optimizer.learning_rate.assign(rate)

    @contextlib.contextmanager
    def _scaled_learning_rate(self, scale: float) -> Iterator[None]:
        """Multiply the learning rate by ``scale`` inside the block, then restore it exactly."""
        if scale == 1.0:
            yield
            return
        if not has_float_learning_rate(self.optimizer):
            raise LearningRateScaleError(
                f"learning-rate scale {scale:g} asked, but the model's {type(self.optimizer).__name__} "
                "uses a learning-rate schedule"
            )
        variable = self.optimizer.learning_rate
        base = variable.numpy()
        variable.assign(base * scale)
        try:
            yield
        finally:
            variable.assign(base)


def _read_only(tensor: tf.Tensor) -> np.ndarray:
    """A read-only numpy view of an eager tensor's buffer (no copy; the tensor never changes)."""
    value = np.asarray(tensor)
    value.flags.writeable = False
    return value


def _state_of(variables: Sequence[keras.Variable]) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def _load_state(variables: Sequence[keras.Variable], values: Sequence[np.ndarray], what: str) -> None:
    if len(values) != len(variables):
        raise ValueError(
            f"{what}: the state has {len(values)} arrays, the optimizer {len(variables)} variables"
        )
    for variable, value in zip(variables, values, strict=True):
        if tuple(variable.shape) != np.shape(value):
            raise ValueError(
                f"{what}: optimizer variable {variable.name} has shape {tuple(variable.shape)}, "
                f"the state {np.shape(value)}"
            )
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


@dataclass(frozen=True)
class _PackedGroup:
    """Small variables of one dtype held as one flat variable: member ``names[i]`` of ``shapes[i]`` is
    elements ``bounds[i]:bounds[i + 1]`` of ``variable``."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    bounds: tuple[int, ...]
    variable: tf.Variable

    def mask(self, present: frozenset[str]) -> np.ndarray | None:
        """The elements of the members named in ``present``; None when that is all of them."""
        if present.issuperset(self.names):
            return None
        mask = np.zeros(self.bounds[-1], dtype=bool)
        for i, name in enumerate(self.names):
            if name in present:
                mask[self.bounds[i] : self.bounds[i + 1]] = True
        return mask


class DenseOptimizer(_KerasOptimizer):
    """One Keras optimizer over a fixed set of named dense variables, which it holds. Not thread-safe.

    When the optimizer updates elementwise (:func:`~edl_argo.model.optimizer.updates_elementwise`, the rule
    that lets a big variable be cut into pieces across PS) and keeps no EMA averages or gradient
    accumulators (:func:`_packs`), the small variables of each dtype that have no
    constraint are held as one flat variable (:func:`~edl_argo.rpc.packed.group_small`): updating it is
    updating each of them. An XLA-compiled Adam over a Transformer's 37 variables took 1.4 ms per call and
    0.9 s to compile, over one flat variable 0.45 ms and 0.1 s. A gradient that names only some members of
    a group updates only those: the update runs over the whole flat variable, then every element of the
    others, in the variable and in each optimizer variable of its shape and dtype (its slots), is set back to
    what it was, so that they end exactly as if they had been left out (``iterations`` counts the step either
    way, as it does for variables left out of ``apply_gradients``). The optimizer's state
    (:meth:`get_state`) follows this storage.
    """

    def __init__(
        self,
        factory: OptimizerFactory,
        values: Mapping[str, np.ndarray],
        constraints: Mapping[str, keras.constraints.Constraint] | None = None,
        jit_compile: bool = True,
    ) -> None:
        """``values``: each variable's initial value by name; ``constraints``: the constraint of those that
        have one (applied after every update, as Keras does). ``jit_compile``: compile the update with XLA
        (falls back to a plain graph if XLA rejects it)."""
        super().__init__(factory)
        constraints = dict(constraints or {})
        arrays = {name: np.asarray(value) for name, value in values.items()}
        self.specs = {name: (value.dtype.name, value.shape) for name, value in arrays.items()}
        packable = [n for n in arrays if n not in constraints] if _packs(self.optimizer) else []
        self._groups = self._packed_groups(arrays, packable)
        packed = {name for group in self._groups for name in group.names}
        self._alone = {
            name: tf.Variable(value, name=_variable_name(name), constraint=constraints.get(name))
            for name, value in values.items()
            if name not in packed
        }
        self._storage = [*(g.variable for g in self._groups), *self._alone.values()]
        self._jit_compile = jit_compile
        self.optimizer.build(self._storage)
        self._steps: dict[tuple[str, ...], Callable[..., list[tf.Tensor]]] = {}

    def _packed_groups(self, arrays: Mapping[str, np.ndarray], packable: Sequence[str]) -> list[_PackedGroup]:
        """The flat variables of the small ones among ``packable`` (:func:`~edl_argo.rpc.packed.group_small`),
        one per dtype. A dtype with one small variable gains nothing; and since the slots of a flat variable
        are found by its shape and dtype (:meth:`_state_like`), no variable held alone may share them."""
        groups, _ = group_small([(arrays[n].nbytes, arrays[n].dtype) for n in packable])
        packed: list[_PackedGroup] = []
        for members in groups.values():
            names = tuple(packable[i] for i in members)
            bounds = tuple(np.cumsum([0, *(arrays[n].size for n in names)]).tolist())
            flat_spec = (arrays[names[0]].dtype.name, (bounds[-1],))
            if len(names) < 2 or flat_spec in {self.specs[n] for n in arrays if n not in names}:
                continue
            flat = np.concatenate([arrays[n].reshape(-1) for n in names])
            variable = tf.Variable(flat, name=f"packed_{len(packed)}")
            packed.append(_PackedGroup(names, tuple(arrays[n].shape for n in names), bounds, variable))
        return packed

    @property
    def packed(self) -> list[tuple[str, ...]]:
        """The names of the variables held together, one tuple per flat variable."""
        return [group.names for group in self._groups]

    def apply(
        self, gradients: Mapping[str, np.ndarray], lr_scale: float = 1.0
    ) -> dict[str, np.ndarray] | None:
        """Apply one gradient per named variable (a subset of the variables is fine) in one optimizer step,
        and return the value of every variable after it (read-only arrays, read by the step itself, so that
        the caller's answer needs no read of its own).

        The names must be variables of this optimizer and each gradient must have its variable's shape
        and dtype (the caller validates requests). An empty mapping changes nothing, not even the
        iteration count, and returns None.
        """
        if not gradients:
            return None
        names = tuple(sorted(gradients))
        present = frozenset(names)
        grads = [
            as_tf_tensor(self._packed_gradient(group, gradients))
            for group in self._groups
            if not present.isdisjoint(group.names)
        ] + [
            as_tf_tensor(np.asarray(gradients[n], dtype=self.specs[n][0])) for n in names if n in self._alone
        ]
        with self._scaled_learning_rate(lr_scale):
            try:
                values = self._step(names)(*grads)
            except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as error:
                if not self._jit_compile:
                    raise
                # XLA refused the graph (it fails while compiling, before any variable changes).
                log.warning("xla_disabled", optimizer=type(self.optimizer).__name__, reason=str(error)[:200])
                self._jit_compile = False
                self._steps.clear()
                values = self._step(names)(*grads)
        return self._named([_read_only(value) for value in values])

    def values(self) -> dict[str, np.ndarray]:
        """A copy of every variable's current value, by name."""
        return self._named([np.array(v.numpy()) for v in self._storage])

    def _named(self, storage_values: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """Every variable's value by name (views) from the values of :attr:`_storage`, in order."""
        named: dict[str, np.ndarray] = {}
        for group, flat in zip(self._groups, storage_values, strict=False):
            for i, name in enumerate(group.names):
                named[name] = flat[group.bounds[i] : group.bounds[i + 1]].reshape(group.shapes[i])
        named.update(zip(self._alone, storage_values[len(self._groups) :], strict=True))
        return {name: named[name] for name in self.specs}

    def _packed_gradient(self, group: _PackedGroup, gradients: Mapping[str, np.ndarray]) -> np.ndarray:
        """A group's gradient as one flat array; zeros for members without one (set back after the update)."""
        flat = np.zeros(group.bounds[-1], dtype=self.specs[group.names[0]][0])
        for i, name in enumerate(group.names):
            if name in gradients:
                flat[group.bounds[i] : group.bounds[i + 1]] = np.asarray(gradients[name]).reshape(-1)
        return flat

    def _step(self, names: tuple[str, ...]) -> Callable[..., list[tf.Tensor]]:
        """The compiled step for gradients of ``names``: a concrete function (no per-call dispatch on its
        arguments) that applies them and returns every variable of :attr:`_storage`'s new value."""
        step = self._steps.get(names)
        if step is None:
            present = frozenset(names)
            touched = [g for g in self._groups if not present.isdisjoint(g.names)]
            variables = [g.variable for g in touched] + [self._alone[n] for n in names if n in self._alone]
            # Members without a gradient: their elements, in the flat variable and in each optimizer
            # variable of its shape and dtype, are set back after the update.
            kept = [
                (tf.constant(mask), [group.variable, *self._state_like(group.variable)])
                for group in touched
                for mask in [group.mask(present)]
                if mask is not None
            ]
            optimizer, storage = self.optimizer, self._storage

            def apply_and_read(*grads: tf.Tensor) -> list[tf.Tensor]:
                before = [[tf.convert_to_tensor(v) for v in held] for _, held in kept]
                optimizer.apply_gradients(zip(grads, variables, strict=True))
                for (mask, held), old in zip(kept, before, strict=True):
                    for variable, value in zip(held, old, strict=True):
                        variable.assign(tf.where(mask, tf.convert_to_tensor(variable), value))
                return [v.read_value() for v in storage]

            traced = step_function(apply_and_read, jit_compile=self._jit_compile)
            step = flat_call(
                traced.get_concrete_function(*(tf.TensorSpec(v.shape, v.dtype) for v in variables))
            )
            self._steps[names] = step
        return step

    def _state_like(self, variable: tf.Variable) -> list[keras.Variable]:
        """The optimizer's variables of ``variable``'s shape and dtype: its slots. Only one flat variable has
        a given dtype, no variable held alone shares its shape and dtype (:meth:`_packed_groups`), and the
        optimizer's other variables are scalars (:func:`_packs`)."""
        return [
            v
            for v in self.optimizer.variables
            if tuple(v.shape) == tuple(variable.shape) and v.dtype == variable.dtype.name
        ]

    def get_state(self) -> list[np.ndarray]:
        """Copies of every optimizer variable (iterations, learning rate, slots, EMA averages) in a stable
        order."""
        return _state_of(self.optimizer.variables)

    def finalized_values(self) -> dict[str, np.ndarray]:
        """The variables' values as ``fit`` ends with them: after the optimizer's
        ``finalize_variable_values`` (EMA averages with ``use_ema``). The variables do not change."""
        current = [np.array(v.numpy()) for v in self._storage]
        self.optimizer.finalize_variable_values(self._storage)
        finalized = self.values()
        for variable, value in zip(self._storage, current, strict=True):
            variable.assign(value)
        return finalized

    def set_state(self, state: Sequence[np.ndarray]) -> None:
        """Load a state from :meth:`get_state` of an optimizer built the same way on the same variables."""
        _load_state(self.optimizer.variables, state, "dense optimizer")


class SparseOptimizer(_KerasOptimizer):
    """Row-wise updates of embedding tables through one staging variable. Not thread-safe.

    One instance serves a *group* of tables of the same row width and dtype, so that a push touching
    every table of a wide model (26 tables, say) costs one optimizer step, not one per table: the touched
    rows of all the group's tables are stacked in the staging variable. Creating it adds the optimizer's
    slots to every table of the group (see the module's assumptions).
    """

    def __init__(
        self,
        factory: OptimizerFactory,
        tables: EmbeddingTable | Sequence[EmbeddingTable],
        capacity: int = _MIN_STAGING_ROWS,
    ) -> None:
        super().__init__(factory)
        self._tables = [tables] if isinstance(tables, EmbeddingTable) else list(tables)
        if not self._tables or len({(t.dim, np.dtype(t.dtype)) for t in self._tables}) != 1:
            raise ValueError("a sparse optimizer serves one or more tables of one row width and dtype")
        self._table = self._tables[0]
        self._build(max(1, capacity))

    @property
    def capacity(self) -> int:
        """Rows of the staging variable: the most unique ids one apply handles without a rebuild."""
        return self._capacity

    def apply(self, ids: np.ndarray, gradients: np.ndarray, lr_scale: float = 1.0) -> None:
        """Apply the gradient rows ``gradients[i]`` of ``ids[i]`` of this optimizer's only table."""
        if len(self._tables) != 1:
            raise ValueError("apply() is for a single table; use apply_many()")
        self.apply_many([(self._table, ids, gradients)], lr_scale)

    def apply_many(
        self, updates: Sequence[tuple[EmbeddingTable, np.ndarray, np.ndarray]], lr_scale: float = 1.0
    ) -> None:
        """Apply ``(table, ids, gradient rows)`` of several tables of the group as one optimizer step.

        Gradients of a repeated id are summed (``IndexedSlices`` semantics). Rows of ids a table does
        not hold yet are created first. Every other row and slot row stays as it is.
        """
        parts = []
        for table, ids, gradients in updates:
            unique_ids, inverse = np.unique(np.asarray(ids, dtype=np.int64), return_inverse=True)
            if len(unique_ids) == 0:
                continue
            summed = np.zeros((len(unique_ids), table.dim), dtype=table.dtype)
            if len(unique_ids) == len(inverse):  # no repeated id: a permutation
                summed[inverse] = gradients
            else:
                np.add.at(summed, inverse.reshape(-1), gradients)
            rows = table.lookup(unique_ids)
            values, slots = table.gather_rows(rows)
            parts.append((table, rows, values, slots, summed))
        count = sum(len(part[1]) for part in parts)
        if count == 0:
            return
        if count > self._capacity:
            self._rebuild(count)
        self._maybe_shrink(count)
        zeros = np.zeros(self._table.dim, dtype=self._table.dtype)
        staged_values = self._padded([p[2] for p in parts], zeros)
        staged_slots = [
            self._padded([p[3][name] for p in parts], self._table.slot_initial_row(name))
            for name in self._slot_names
        ]
        staged_grads = self._padded([p[4] for p in parts], zeros)
        with self._scaled_learning_rate(lr_scale):
            new_values, new_slots = self._step(staged_values, staged_slots, staged_grads)
        new_values = new_values.numpy()
        new_slots = [slot.numpy() for slot in new_slots]
        offset = 0
        for table, rows, *_ in parts:
            end = offset + len(rows)
            table.scatter_rows(
                rows,
                table.constrain(new_values[offset:end]),
                {name: slot[offset:end] for name, slot in zip(self._slot_names, new_slots, strict=True)},
            )
            offset = end

    def get_state(self) -> list[np.ndarray]:
        """Copies of the optimizer's scalar variables (iterations, learning rate, ...); the slot rows are
        part of the table."""
        return _state_of(self._scalars)

    def set_state(self, state: Sequence[np.ndarray]) -> None:
        """Load a state from :meth:`get_state` of an optimizer built the same way."""
        _load_state(self._scalars, state, f"optimizer of embedding table {self._table.name!r}")

    def _padded(self, blocks: Sequence[np.ndarray], fill: np.ndarray) -> np.ndarray:
        staged = np.empty((self._capacity, self._table.dim), dtype=self._table.dtype)
        offset = 0
        for block in blocks:
            staged[offset : offset + len(block)] = block
            offset += len(block)
        staged[offset:] = fill
        return staged

    def _maybe_shrink(self, count: int) -> None:
        """Count applies of ``count`` rows that used at most a quarter of the capacity; after
        :data:`SHRINK_AFTER_APPLIES` of them in a row, rebuild at the largest of them (power of two)."""
        if self._capacity <= _MIN_STAGING_ROWS or 4 * count > self._capacity:
            self._small_applies, self._small_peak = 0, 0
            return
        self._small_applies += 1
        self._small_peak = max(self._small_peak, count)
        if self._small_applies >= SHRINK_AFTER_APPLIES:
            log.info("staging_shrunk", table=self._table.name, capacity=self._capacity, peak=self._small_peak)
            self._rebuild(max(_MIN_STAGING_ROWS, self._small_peak))

    def _rebuild(self, rows: int) -> None:
        """Set the staging capacity to the next power of two >= ``rows`` with a fresh optimizer instance
        that carries over the scalar state."""
        state = self.get_state()
        self.optimizer = new_optimizer(self._factory)
        self._build(1 << (rows - 1).bit_length())
        self.set_state(state)

    def _build(self, capacity: int) -> None:
        table, optimizer = self._table, self.optimizer  # every table of the group has this shape
        self._capacity = capacity
        self._small_applies, self._small_peak = 0, 0
        before = {id(v) for v in optimizer.variables}
        staging = tf.Variable(
            tf.zeros((capacity, table.dim), dtype=table.dtype), name="staging", trainable=True
        )
        optimizer.build([staging])
        created = [v for v in optimizer.variables if id(v) not in before]
        slot_vars = [v for v in created if tuple(v.shape) == (capacity, table.dim)]
        slot_ids = {id(v) for v in slot_vars}
        others = [v for v in created if id(v) not in slot_ids and len(v.shape) > 0]
        if others:
            raise ConfigError(
                f"{type(optimizer).__name__} keeps non-elementwise state {[tuple(v.shape) for v in others]} "
                f"for embedding table {table.name!r}; sparse updates need an elementwise optimizer "
                "(SGD, Adam, Adagrad, RMSprop, ...)"
            )
        self._slot_names = _slot_names(slot_vars)
        for name, variable in zip(self._slot_names, slot_vars, strict=True):
            fresh = variable.numpy()
            if not (fresh == fresh[0]).all():
                raise ConfigError(
                    f"{type(optimizer).__name__}: slot {name!r} of embedding table {table.name!r} does not "
                    "start constant; sparse updates cannot create its rows"
                )
            for member in self._tables:
                member.add_slot(name, fresh[0])
        self._scalars = [v for v in optimizer.variables if id(v) not in slot_ids]

        def step(
            values: tf.Tensor, slots: list[tf.Tensor], grads: tf.Tensor
        ) -> tuple[tf.Tensor, list[tf.Tensor]]:
            staging.assign(values)
            for variable, value in zip(slot_vars, slots, strict=True):
                variable.assign(value)
            optimizer.apply_gradients([(grads, staging)])
            return tf.identity(staging), [tf.convert_to_tensor(v) for v in slot_vars]

        self._step = step_function(step)


def _packs(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether :class:`DenseOptimizer` may hold ``optimizer``'s small variables as one: an elementwise update,
    and no state Keras changes for variables a step leaves out (EMA averages move toward every variable's
    value, and gradient accumulators are all reset, at each step)."""
    return (
        updates_elementwise(optimizer) and not optimizer.use_ema and not optimizer.gradient_accumulation_steps
    )


def _variable_name(name: str) -> str:
    """A TensorFlow-safe variable name (for debugging only; the dictionary key is the real name)."""
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name) or "v"


def _slot_names(slot_vars: Sequence[keras.Variable]) -> list[str]:
    """Short, unique slot names: Keras names them ``staging_0_<slot>`` after the staging variable."""
    names: list[str] = []
    for index, variable in enumerate(slot_vars):
        name = variable.name.removeprefix("staging_0_")
        names.append(name if name not in names else f"{name}_{index}")
    return names
