"""The partition of the model one parameter server holds, and the gradients it accepts.

:class:`Parameters` owns this server's dense variables (one ``tf.Variable`` per name, carrying its Keras
constraint), its non-trainable variables (values taken from pushes), its embedding tables, the optimizers
that update them and the model version. It validates everything that arrives from a worker
and raises :class:`InvalidRequestError` (the request does not fit this server's parameters) or
:class:`NotInitializedError` (no worker has pushed the model yet) with a one-line reason naming the
variable or table at fault; nothing changes when it raises.

It is not thread-safe: :class:`~edl_argo.ps.servicer.ParameterServerServicer` serialises every call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from edl_argo.errors import ConfigError
from edl_argo.model.inventory import load_constraint
from edl_argo.model.optimizer import OptimizerFactory, has_float_learning_rate, new_optimizer
from edl_argo.proto import ps_pb2
from edl_argo.ps import bounds
from edl_argo.ps.embedding_table import FLOAT_DTYPES, EmbeddingTable, TableArrays
from edl_argo.ps.errors import InvalidRequestError, NotInitializedError
from edl_argo.ps.optimizer import DenseOptimizer, LearningRateScaleError, SparseOptimizer
from edl_argo.ps.partition import DensePlacement, embedding_owner
from edl_argo.ps.pushed import NamedArrays, PushedModel
from edl_argo.rpc.packed import read_all
from edl_argo.rpc.tensors import from_indexed_slices


@dataclass
class Gradients:
    """Validated gradients of one push: dense by variable name, sparse as ``(ids, values)`` by table, and
    how the push's forward pass changed non-trainable variables (``state_changes``, added to their values:
    a change computed from an older value than the current one is not lost)."""

    dense: dict[str, np.ndarray] = field(default_factory=dict)
    embeddings: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    state_changes: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The bytes of the gradients: the dense values and the embedding rows (not their ids, nor the
        state changes)."""
        return sum(g.nbytes for g in self.dense.values()) + sum(v.nbytes for _, v in self.embeddings.values())


@dataclass
class TableState:
    """One embedding table in a :class:`ParametersState`."""

    dim: int
    initializer: str
    dtype: str
    arrays: TableArrays
    #: :meth:`SparseOptimizer.get_state` (iterations and other scalars; slot rows are in ``arrays``).
    optimizer: list[np.ndarray]
    #: :meth:`EmbeddingTable.seed_state`.
    seed_state: np.ndarray | None
    #: The table's constraint (JSON), empty for none.
    constraint: str = ""


@dataclass
class ParametersState:
    """Everything a parameter server must save to resume exactly where it was (see :mod:`.checkpoint`)."""

    version: int
    dense: dict[str, np.ndarray]
    #: :meth:`DenseOptimizer.get_state`; empty when the server holds no dense variable.
    dense_optimizer: list[np.ndarray]
    tables: dict[str, TableState]
    #: Non-trainable variables (BatchNormalization statistics, ...).
    non_trainable: dict[str, np.ndarray] = field(default_factory=dict)
    #: The constraint of each dense variable that has one (JSON, see :mod:`edl_argo.model.inventory`).
    constraints: dict[str, str] = field(default_factory=dict)
    #: The bytes of every dense variable of the whole model, on every PS (the ``dense_layout`` of the
    #: ``PushModel`` that initialised the server): where each one lives follows from it
    #: (:class:`~edl_argo.ps.partition.DensePlacement`).
    layout: dict[str, int] = field(default_factory=dict)


class Parameters:
    """This server's parameters, their optimizers and the model version.

    Contract:

    * Uninitialised until :meth:`init_from_model` or :meth:`restore`; only the first of them counts.
    * :attr:`version` increases by exactly one per :meth:`apply_gradients`.
    * Embedding rows are created on first pull (or first gradient) with the table's initializer.
    * A dense variable's constraint is applied after each update that touches it (by the Keras optimizer);
      a non-trainable variable takes the value a push carries, with that push's step.
    """

    def __init__(
        self,
        optimizer_factory: OptimizerFactory,
        ps_id: int = 0,
        num_ps: int = 1,
        jit_compile: bool = True,
        learning_rate_at: Callable[[int], float] | None = None,
        max_embedding_rows: int = 0,
    ) -> None:
        """``learning_rate_at(version)``: the learning rate of the update from ``version`` (the model's
        ``LearningRateScheduler``); None: the optimizer's own. ``max_embedding_rows``: the most rows one
        table may hold on this server (0: no bound); a pull or push that would create more is refused
        (:class:`~edl_argo.ps.bounds.ResourceLimitError`) before it creates any."""
        if not 0 <= ps_id < num_ps:
            raise ValueError(f"ps_id {ps_id} is not in [0, num_ps={num_ps})")
        self.max_embedding_rows = max_embedding_rows
        self.ps_id = ps_id
        self.num_ps = num_ps
        self._factory = optimizer_factory
        self._jit_compile = jit_compile
        self._learning_rate_at = learning_rate_at
        self._reset()
        #: Whether the optimizer's learning rate is a float that ``apply_gradients(lr_scale=...)`` can scale.
        self.lr_scalable = has_float_learning_rate(new_optimizer(optimizer_factory))

    # -- initialisation -------------------------------------------------------------------------------

    def init_from_model(self, model: ps_pb2.Model) -> bool:
        """Create the parameters from a worker's model; False (and no change) if already initialised, unless
        the model's ``dense_layout`` differs from the one this server holds: then InvalidRequestError (a
        worker of another model, or of other pieces, would push variables this server does not have).

        Dense tensors must be float, named, distinct and exactly this server's share of the model's
        ``dense_layout`` (:class:`DensePlacement`; a model without one, with one PS, is all its own).
        Tables must have a name, a positive dim, a float dtype and an initializer Keras knows. The model
        must not carry embedding rows (tables start empty). The model's version becomes this server's.
        """
        if self.initialized:
            offered = dict(model.dense_layout)
            if offered and offered != self.layout:
                name = min(
                    set(offered) ^ set(self.layout) or {n for n in offered if offered[n] != self.layout[n]}
                )
                raise InvalidRequestError(
                    f"PushModel: the model's dense layout differs from the one PS {self.ps_id} holds (first"
                    f" at dense variable {name!r}): the worker runs another model, or the PS restored a"
                    " checkpoint of another one"
                )
            return False
        bounds.check_version("version", model.version)
        if model.embedding_tables:
            raise InvalidRequestError(
                f"PushModel carries rows of embedding tables {sorted(model.embedding_tables)}; "
                "tables start empty and rows are created on first pull"
            )
        dense: dict[str, np.ndarray] = {}
        for name, value in read_all(model.dense_parameters, model.packed_dense_parameters):
            self._check_dense_name(name, dense)
            if value.dtype.name not in FLOAT_DTYPES:
                raise InvalidRequestError(f"dense variable {name!r}: dtype {value.dtype} is not float")
            dense[name] = value
        non_trainable: dict[str, np.ndarray] = {}
        for name, value in read_all(model.non_trainable_parameters, model.packed_non_trainable_parameters):
            self._check_dense_name(name, [*dense, *non_trainable])
            if value.dtype.name not in FLOAT_DTYPES:
                raise InvalidRequestError(
                    f"non-trainable variable {name!r}: dtype {value.dtype} is not float"
                )
            non_trainable[name] = np.array(value)
        held = {**dense, **non_trainable}
        layout = self._layout_or_own(dict(model.dense_layout), held)
        problem = self._share_problem(layout, held)
        if problem is not None:
            raise InvalidRequestError(f"PushModel: {problem}")
        for name, serialized in model.constraints.items():
            if name not in dense:
                raise InvalidRequestError(f"constraint for unknown dense variable {name!r}")
            try:
                load_constraint(serialized)
            except ValueError as error:
                raise InvalidRequestError(f"dense variable {name!r}: {error}") from None
        tables: dict[str, EmbeddingTable] = {}
        for info in model.embedding_table_infos:
            if not info.name or info.name in tables:
                raise InvalidRequestError(f"embedding table name {info.name!r} is empty or repeated")
            try:
                tables[info.name] = EmbeddingTable(
                    info.name,
                    info.dim,
                    info.initializer or "uniform",
                    info.dtype or "float32",
                    constraint=info.constraint,
                )
            except ValueError as error:
                raise InvalidRequestError(str(error)) from None
        self._create(dense, tables, non_trainable, dict(model.constraints), layout)
        self.version = max(0, model.version)
        return True

    def restore(self, state: ParametersState) -> None:
        """Become exactly the server that produced ``state`` (before it serves any request)."""
        if self.initialized:
            raise RuntimeError("restore() on parameters that are initialised already")
        held = {**state.dense, **state.non_trainable}
        layout = self._layout_or_own(state.layout, held)
        if not layout:
            raise ConfigError(
                f"the checkpoint of PS {self.ps_id} was written by an edl-argo that placed dense variables "
                "by name; with several PS it cannot be restored: start the job without it"
            )
        problem = self._share_problem(layout, held)
        if problem is not None:
            raise ConfigError(
                f"the checkpoint of PS {self.ps_id} does not fit --num-ps {self.num_ps} ({problem}): it was "
                "written with another --num-ps"
            )
        try:
            tables = {
                name: EmbeddingTable(name, t.dim, t.initializer, t.dtype, constraint=t.constraint)
                for name, t in state.tables.items()
            }
            self._create(state.dense, tables, state.non_trainable, state.constraints, layout)
            if self._dense_optimizer is not None:
                self._dense_optimizer.set_state(state.dense_optimizer)
            for name, table_state in state.tables.items():
                self.tables[name].load_arrays(table_state.arrays)
                self.tables[name].set_seed_state(table_state.seed_state)
                self._table_optimizers[name].set_state(table_state.optimizer)
        except ValueError as error:
            self._reset()
            raise ConfigError(
                f"the checkpoint of PS {self.ps_id} does not fit the model's optimizer ({error}): it was "
                "written for another optimizer, or by an edl-argo before 0.2.0 (one slot per small variable, "
                "where 0.2.0 packs them); start the job without it"
            ) from None
        self.version = state.version

    def snapshot(self) -> ParametersState:
        """A copy of the whole state (values, optimizer variables, version), safe to use after unlocking."""
        self._require_initialized()
        return ParametersState(
            version=self.version,
            dense=self.dense_values(),
            dense_optimizer=[] if self._dense_optimizer is None else self._dense_optimizer.get_state(),
            tables={
                name: TableState(
                    dim=table.dim,
                    initializer=table.initializer,
                    constraint=table.constraint,
                    dtype=table.dtype.name,
                    arrays=table.to_arrays(),
                    optimizer=self._table_optimizers[name].get_state(),
                    seed_state=table.seed_state(),
                )
                for name, table in self.tables.items()
            },
            non_trainable={name: np.array(value) for name, value in self.non_trainable.items()},
            constraints=dict(self.constraints),
            layout=dict(self.layout),
        )

    # -- pulls ----------------------------------------------------------------------------------------

    def pull_dense(self, since_version: int, finalized: bool = False) -> list[tuple[str, np.ndarray]] | None:
        """The value of every dense variable, trainable then non-trainable (arrays the caller must not
        change), or None when ``since_version`` is the current version.

        A caller whose version differs from this server's (older, -1 for none, or newer after this server
        restarted from a checkpoint) gets every variable. ``finalized``: the trainable values as ``fit``
        ends with them (the optimizer's ``finalize_variable_values``: EMA averages when it keeps them);
        the variables themselves do not change.
        """
        self._require_initialized()
        if since_version == self.version and not finalized:
            return None
        if finalized and self._dense_optimizer is not None:
            trainable = self._dense_optimizer.finalized_values()
        elif self._latest_dense is not None and self._latest_dense[0] == self.version:
            trainable = self._latest_dense[1]  # what the last update read: no read of its own
        else:
            trainable = self.dense_values()
        return [*trainable.items(), *((name, np.array(v)) for name, v in self.non_trainable.items())]

    def pull_embeddings(self, name: str, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` (int64, 1-D, owned by this server) of table ``name``, created if new."""
        table = self._table(name)
        self._check_ids(name, ids)
        bounds.check_reply_size(name, len(ids), table.dim * table.dtype.itemsize)
        self._check_new_rows(table, ids)
        return table.get(ids)

    def export_table(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Every ``(ids, rows)`` this server holds of table ``name``."""
        table = self._table(name)
        return table.ids(), table.get(table.ids())

    # -- pushes ---------------------------------------------------------------------------------------

    def decode_gradients(self, model: PushedModel) -> Gradients:
        """Decode and check a push: every name known, every shape and dtype its variable's or table's.

        The arrays may be read-only views of the message's bytes. Raises :class:`InvalidRequestError`,
        :class:`~edl_argo.rpc.tensors.TensorDecodeError` or :class:`NotInitializedError`.
        """
        self._require_initialized()
        gradients = Gradients()
        gradients.dense = _check_named(model.dense, self.dense, "gradient", "dense variable")
        state = {name: (v.dtype.name, v.shape) for name, v in self.non_trainable.items()}
        gradients.state_changes = _check_named(model.non_trainable, state, "change", "non-trainable variable")
        for name, slices in model.embedding_tables.items():
            table = self._table(name)
            values, ids = from_indexed_slices(slices)
            if values.dtype != table.dtype or values.shape[1:] != (table.dim,):
                raise InvalidRequestError(
                    f"gradient for embedding table {name!r} is {values.dtype.name}{list(values.shape)}, "
                    f"rows of the table are {table.dtype.name}[{table.dim}]"
                )
            self._check_ids(name, ids)
            self._check_new_rows(table, ids)
            gradients.embeddings[name] = (ids, values)
        return gradients

    def apply_gradients(self, gradients: Gradients, lr_scale: float = 1.0) -> None:
        """Apply checked gradients as one optimizer step, add the changes of non-trainable variables they
        carry, and advance the version by one.

        ``lr_scale`` multiplies the learning rate for this step only; other than 1 it needs a float
        learning rate (:class:`LearningRateScaleError`, raised before anything changes).
        """
        self._require_initialized()
        if lr_scale != 1.0 and not self.lr_scalable:
            raise LearningRateScaleError(
                f"learning-rate scale {lr_scale:g} asked, but the model's optimizer uses a schedule"
            )
        if self._learning_rate_at is not None:
            rate = self._learning_rate_at(self.version)
            for optimizer in {
                id(o): o for o in (self._dense_optimizer, *self._table_optimizers.values())
            }.values():
                if optimizer is not None:
                    optimizer.set_learning_rate(rate)
        updated = None
        if self._dense_optimizer is not None:
            updated = self._dense_optimizer.apply(gradients.dense, lr_scale)
        by_group: dict[int, list[tuple[EmbeddingTable, np.ndarray, np.ndarray]]] = {}
        for name, (ids, values) in gradients.embeddings.items():
            by_group.setdefault(id(self._table_optimizers[name]), []).append((self.tables[name], ids, values))
        for updates in by_group.values():
            self._table_optimizers[updates[0][0].name].apply_many(updates, lr_scale)
        for name, change in gradients.state_changes.items():
            value = self.non_trainable[name]
            self.non_trainable[name] = np.asarray(value + change, dtype=value.dtype)
        self.version += 1
        self._latest_dense = None if updated is None else (self.version, updated)

    # -- helpers --------------------------------------------------------------------------------------

    def dense_values(self) -> dict[str, np.ndarray]:
        """A copy of every trainable dense variable's current value, by name."""
        return {} if self._dense_optimizer is None else self._dense_optimizer.values()

    def _reset(self) -> None:
        self.version = 0
        self.initialized = False
        #: The trainable dense variables this server holds: dtype name and shape by name (the values are
        #: the dense optimizer's).
        self.dense: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.non_trainable: dict[str, np.ndarray] = {}
        self.constraints: dict[str, str] = {}
        self.layout: dict[str, int] = {}
        self.tables: dict[str, EmbeddingTable] = {}
        self._dense_optimizer: DenseOptimizer | None = None
        self._table_optimizers: dict[str, SparseOptimizer] = {}
        # The dense values the last update returned, and the version they are of.
        self._latest_dense: tuple[int, dict[str, np.ndarray]] | None = None

    def _create(
        self,
        dense: dict[str, np.ndarray],
        tables: dict[str, EmbeddingTable],
        non_trainable: dict[str, np.ndarray],
        constraints: dict[str, str],
        layout: dict[str, int],
    ) -> None:
        # The Keras optimizer applies a variable's constraint after each update, as in fit.
        dense_optimizer = (
            DenseOptimizer(
                self._factory,
                dense,
                {name: load_constraint(constraints[name]) for name in constraints},
                self._jit_compile,
            )
            if dense
            else None
        )
        groups: dict[tuple[int, str], list[EmbeddingTable]] = {}
        for table in tables.values():
            groups.setdefault((table.dim, np.dtype(table.dtype).name), []).append(table)
        optimizers = {
            table.name: optimizer
            for members in groups.values()
            for optimizer in [SparseOptimizer(self._factory, members)]
            for table in members
        }
        self.dense = {} if dense_optimizer is None else dict(dense_optimizer.specs)
        self.tables = tables
        self.non_trainable = {name: np.array(value) for name, value in non_trainable.items()}
        self.constraints = dict(constraints)
        self.layout = dict(layout)
        self._dense_optimizer, self._table_optimizers = dense_optimizer, optimizers
        self.initialized = True

    def _check_dense_name(self, name: str, seen: Iterable[str]) -> None:
        if not name or name in seen:
            raise InvalidRequestError(f"dense variable name {name!r} is empty or repeated")

    def _layout_or_own(self, layout: dict[str, int], held: Mapping[str, np.ndarray]) -> dict[str, int]:
        """``layout``, or when it is empty and this is the only PS, the layout of the variables ``held``
        (all of the model's: a model or checkpoint from before layouts, or a hand-made one)."""
        if layout or self.num_ps != 1:
            return layout
        return {name: np.asarray(value).nbytes for name, value in held.items()}

    def _share_problem(self, layout: Mapping[str, int], held: Mapping[str, np.ndarray]) -> str | None:
        """Why the dense variables ``held`` are not exactly this server's share of the model whose
        ``layout`` (name: bytes) is given, or None when they are."""
        unknown = sorted(set(held) - set(layout))
        if unknown:
            return f"dense variable {unknown[0]!r} is not in the model's dense_layout"
        resized = sorted(name for name, value in held.items() if np.asarray(value).nbytes != layout[name])
        if resized:
            name = resized[0]
            size = np.asarray(held[name]).nbytes
            return f"dense variable {name!r} has {size} bytes, its dense_layout {layout[name]}"
        try:
            placement = DensePlacement.of(layout, self.num_ps)
        except ValueError as error:
            return str(error)
        ours = placement.held_by(self.ps_id)
        foreign = sorted(set(held) - ours)
        if foreign:
            name = foreign[0]
            owner = placement.owner(name)
            return f"dense variable {name!r} belongs to PS {owner} of {self.num_ps}, not to PS {self.ps_id}"
        absent = sorted(ours - set(held))
        if absent:
            return f"dense variable {absent[0]!r} of PS {self.ps_id} is missing ({len(absent)} in all)"
        return None

    def _check_new_rows(self, table: EmbeddingTable, ids: np.ndarray) -> None:
        """Refuse ids that would grow ``table`` beyond ``max_embedding_rows`` (nothing is created)."""
        limit = self.max_embedding_rows
        if limit and len(table) + len(ids) > limit:
            bounds.check_row_limit(table.name, len(table), table.count_new(ids), limit)

    def _check_ids(self, name: str, ids: np.ndarray) -> None:
        if ids.dtype != np.int64:
            raise InvalidRequestError(
                f"ids for embedding table {name!r} are {ids.dtype.name}; they must be int64"
            )
        if ids.ndim != 1:
            raise InvalidRequestError(
                f"ids for embedding table {name!r} must be 1-D int64, got {ids.dtype.name}{list(ids.shape)}"
            )
        owners = embedding_owner(ids, self.num_ps)
        foreign = np.flatnonzero(owners != self.ps_id)
        if len(foreign):
            raise InvalidRequestError(
                f"embedding table {name!r}: id {int(ids[foreign[0]])} belongs to PS "
                f"{int(owners[foreign[0]])} of {self.num_ps}, not to PS {self.ps_id}"
            )

    def _table(self, name: str) -> EmbeddingTable:
        self._require_initialized()
        table = self.tables.get(name)
        if table is None:
            raise InvalidRequestError(f"unknown embedding table {name!r}")
        return table

    def _require_initialized(self) -> None:
        if not self.initialized:
            raise NotInitializedError("the model is not initialised yet: no worker has pushed it (PushModel)")


def _check_named(
    tensors: NamedArrays, expected: dict[str, tuple[str, tuple[int, ...]]], noun: str, kind: str
) -> dict[str, np.ndarray]:
    """``tensors`` by name, each named after an entry of ``expected`` (its dtype name and shape), at most
    once; :class:`InvalidRequestError` naming the tensor (``noun`` for ``kind`` NAME) otherwise."""
    checked: dict[str, np.ndarray] = {}
    for name, value in tensors:
        wanted = expected.get(name)
        if wanted is None:
            raise InvalidRequestError(f"{noun} for unknown {kind} {name!r}")
        if name in checked:
            raise InvalidRequestError(f"two {noun}s for {kind} {name!r}")
        if value.shape != wanted[1] or value.dtype != wanted[0]:  # numpy builds a dtype's name in Python
            raise InvalidRequestError(
                f"{noun} for {kind} {name!r} is {value.dtype.name}{list(value.shape)}, "
                f"the variable {wanted[0]}{list(wanted[1])}"
            )
        checked[name] = value
    return checked
