"""One embedding table's rows on one parameter server.

Rows live in a growable numpy array; a dict maps each id to its row. A row is created the first time its id
is looked up, with the table's Keras initializer. Optimizer slot rows (Adam's ``m`` and ``v``, Adagrad's
accumulator, ...) are stored alongside under the same id -> row mapping, so that a sparse update can gather
and scatter a row and its slots together (see :mod:`edl_argo.ps.optimizer`).

An :class:`EmbeddingTable` is not thread-safe: the parameter server serialises every call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from edl_argo.model.inventory import load_constraint

_MIN_CAPACITY = 64
#: dtypes a table (and a dense variable) may have.
FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})


@dataclass
class TableArrays:
    """A copy of a table's content: ``values[i]`` and ``slots[name][i]`` are the rows of ``ids[i]``."""

    ids: np.ndarray
    values: np.ndarray
    slots: dict[str, np.ndarray] = field(default_factory=dict)


def parse_initializer(initializer: str) -> keras.initializers.Initializer:
    """A Keras initializer from its name (``"uniform"``) or its serialized config as JSON.

    Raises :class:`ValueError` naming the initializer when Keras does not know it.
    """
    spec: Any = initializer
    if initializer.lstrip().startswith("{"):
        try:
            spec = json.loads(initializer)
        except json.JSONDecodeError as error:
            raise ValueError(f"initializer {initializer!r} is not valid JSON: {error}") from None
    try:
        return keras.initializers.get(spec)
    except (ValueError, TypeError) as error:
        raise ValueError(f"unknown Keras initializer {initializer!r}: {error}") from None


#: Fresh rows drawn from the initializer per call (see :meth:`EmbeddingTable._fresh_rows`).
INIT_BLOCK_ROWS = 4096


class EmbeddingTable:
    """Rows of one embedding table, created lazily.

    Contract:

    * :meth:`get` returns, for each id, the same row on every call until :meth:`set` or an optimizer
      update changes it; ids never seen before get fresh rows from ``initializer``.
    * Random initializers draw from a :class:`keras.random.SeedGenerator`, so rows created by different
      calls differ (a Keras initializer seeded with an int, or unseeded, would repeat the same values on
      every call). The generator's state is part of :meth:`seed_state` so a restored table creates the
      same rows as the original would have.
    * Slot rows (:meth:`add_slot`) start as the slot's initial row for every row, existing or future.
    """

    def __init__(
        self,
        name: str,
        dim: int,
        initializer: str = "uniform",
        dtype: str = "float32",
        seed: int | None = None,
        constraint: str = "",
    ) -> None:
        """Raises :class:`ValueError` for a non-positive ``dim``, a non-float dtype or an unknown initializer
        or constraint.

        ``seed`` seeds the row initializer; without one, the initializer's configured seed is used, or a
        random seed when it has none. ``constraint``: the table's Keras constraint as JSON (empty for none),
        applied by :meth:`constrain`.
        """
        if dim < 1:
            raise ValueError(f"embedding table {name!r}: dim must be positive, got {dim}")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"embedding table {name!r}: dtype must be one of {sorted(FLOAT_DTYPES)}, got {dtype!r}"
            )
        self.name = name
        self.dim = int(dim)
        self.dtype = np.dtype(dtype)
        self.initializer = initializer
        self.constraint = constraint
        try:
            self._initializer = parse_initializer(initializer)
            self._constraint = load_constraint(constraint) if constraint else None
        except ValueError as error:
            raise ValueError(f"embedding table {name!r}: {error}") from None
        self._seed_generator: keras.random.SeedGenerator | None = None
        if hasattr(self._initializer, "seed"):
            configured = self._initializer.get_config().get("seed")
            seed = seed if seed is not None else configured if isinstance(configured, int) else None
            self._seed_generator = keras.random.SeedGenerator(seed)
            self._initializer.seed = self._seed_generator
        self._block = np.empty((0, self.dim), dtype=self.dtype)
        self._block_used = 0
        if self._seed_generator is not None:
            self._block_seed = np.asarray(self._seed_generator.state.numpy())
        self._index: dict[int, int] = {}
        self._size = 0
        self._ids = np.empty(_MIN_CAPACITY, dtype=np.int64)
        self._values = np.empty((_MIN_CAPACITY, self.dim), dtype=self.dtype)
        self._slots: dict[str, np.ndarray] = {}
        self._slot_initial: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        """The number of rows (distinct ids) the table holds."""
        return self._size

    @property
    def slot_names(self) -> list[str]:
        """Names of the slots, in the order they were added."""
        return list(self._slots)

    def add_slot(self, name: str, initial_row: np.ndarray) -> None:
        """Keep a slot row per row, starting (for every existing and future row) as ``initial_row``.

        Adding a slot that exists already with the same initial row is a no-op.
        """
        initial = np.asarray(initial_row, dtype=self.dtype).reshape(self.dim)
        if name in self._slots:
            if not np.array_equal(self._slot_initial[name], initial):
                raise ValueError(
                    f"embedding table {self.name!r}: slot {name!r} exists with another initial row"
                )
            return
        slot = np.empty_like(self._values)
        slot[: self._size] = initial
        self._slots[name] = slot
        self._slot_initial[name] = initial

    def slot_initial_row(self, name: str) -> np.ndarray:
        """The value a row of slot ``name`` starts with (read-only)."""
        row = self._slot_initial[name].view()
        row.flags.writeable = False
        return row

    def lookup(self, ids: np.ndarray, initialize: bool = True) -> np.ndarray:
        """Row indices of ``ids`` (1-D int64), creating the rows of ids not seen before.

        New rows are filled by the initializer when ``initialize``; otherwise their values are unspecified
        and the caller must overwrite them. Duplicated ids map to the same row.
        """
        ids = np.asarray(ids, dtype=np.int64)
        index = self._index
        rows = np.fromiter((index.get(i, -1) for i in ids.tolist()), dtype=np.int64, count=ids.shape[0])
        missing = rows < 0
        if missing.any():
            new_ids = np.unique(ids[missing])
            start = self._create_rows(new_ids, initialize)
            rows[missing] = start + np.searchsorted(new_ids, ids[missing])
        return rows

    def count_new(self, ids: np.ndarray) -> int:
        """How many distinct ids of ``ids`` the table holds no row for (nothing is created)."""
        index = self._index
        return sum(1 for i in np.unique(np.asarray(ids, dtype=np.int64)).tolist() if i not in index)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """A copy of the rows of ``ids``, shaped ``(len(ids), dim)``; unseen ids get new rows."""
        rows = self.lookup(ids)  # first: creating rows may reallocate the arrays
        return self._values[rows]

    def set(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Overwrite the rows of ``ids`` (created if needed) with ``values``; slot rows stay as they are."""
        values = np.asarray(values)
        if values.shape != (len(ids), self.dim):
            raise ValueError(
                f"embedding table {self.name!r}: {len(ids)} ids need values of shape "
                f"{(len(ids), self.dim)}, got {values.shape}"
            )
        rows = self.lookup(ids, initialize=False)
        self._values[rows] = values

    def gather_rows(self, rows: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Copies of the values and every slot at row indices ``rows`` (from :meth:`lookup`)."""
        return self._values[rows], {name: slot[rows] for name, slot in self._slots.items()}

    def scatter_rows(self, rows: np.ndarray, values: np.ndarray, slots: Mapping[str, np.ndarray]) -> None:
        """Write values and slot values at row indices ``rows``; ``slots`` may name a subset of the slots."""
        self._values[rows] = values
        for name, slot_values in slots.items():
            self._slots[name][rows] = slot_values

    def constrain(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` of this table after its constraint (the rows as they are when it has none). Keras applies
        a constraint to the whole table; per-row constraints (NonNeg, MaxNorm(axis=1), ...) give the same
        rows."""
        if self._constraint is None:
            return rows
        return keras.ops.convert_to_numpy(self._constraint(keras.ops.convert_to_tensor(rows)))

    def ids(self) -> np.ndarray:
        """A copy of the ids the table holds, in the order their rows were created."""
        return self._ids[: self._size].copy()

    def to_arrays(self) -> TableArrays:
        """A copy of every id, row and slot row (for export and checkpoints)."""
        n = self._size
        return TableArrays(
            ids=self._ids[:n].copy(),
            values=self._values[:n].copy(),
            slots={name: slot[:n].copy() for name, slot in self._slots.items()},
        )

    def load_arrays(self, arrays: TableArrays) -> None:
        """Replace the whole content with ``arrays``; every slot of the table must be present in it."""
        ids = np.asarray(arrays.ids, dtype=np.int64)
        if len(np.unique(ids)) != len(ids):
            raise ValueError(f"embedding table {self.name!r}: duplicate ids in the arrays to load")
        if set(arrays.slots) != set(self._slots):
            raise ValueError(
                f"embedding table {self.name!r}: arrays have slots {sorted(arrays.slots)}, "
                f"the table has {sorted(self._slots)}"
            )
        self._index = {}
        self._size = 0
        rows = self.lookup(ids, initialize=False)
        self.scatter_rows(rows, arrays.values, arrays.slots)

    def seed_state(self) -> np.ndarray | None:
        """Where the row initializer's random stream stands (None for deterministic initializers): the
        generator's state before the current block of fresh rows was drawn, then the rows used of it."""
        if self._seed_generator is None:
            return None
        return np.append(self._block_seed, np.asarray(self._block_used, dtype=self._block_seed.dtype))

    def set_seed_state(self, state: np.ndarray | None) -> None:
        """Restore a state from :meth:`seed_state`."""
        if self._seed_generator is None or state is None:
            return
        state = np.asarray(state, dtype=self._seed_generator.state.dtype)
        self._seed_generator.state.assign(state[:-1])
        self._block = np.empty((0, self.dim), dtype=self.dtype)
        self._block_used = 0
        if int(state[-1]):
            self._draw_block()
            self._block_used = int(state[-1])

    def _fresh_rows(self, count: int) -> np.ndarray:
        """The next ``count`` rows of the initializer's stream.

        Rows are drawn in blocks of ``INIT_BLOCK_ROWS`` (one initializer call per block, not per pull:
        a call costs milliseconds), so the stream of rows depends only on the seed, never on how pulls
        were batched. Shape-dependent initializers see the block's shape.
        """
        parts = []
        while count:
            if self._block_used == len(self._block):
                self._draw_block()
            take = min(count, len(self._block) - self._block_used)
            parts.append(self._block[self._block_used : self._block_used + take])
            self._block_used += take
            count -= take
        return np.concatenate(parts) if len(parts) != 1 else parts[0]

    def _draw_block(self) -> None:
        if self._seed_generator is not None:
            self._block_seed = np.asarray(self._seed_generator.state.numpy())
        self._block = keras.ops.convert_to_numpy(
            self._initializer(shape=(INIT_BLOCK_ROWS, self.dim), dtype=self.dtype.name)
        )
        self._block_used = 0

    def _create_rows(self, new_ids: np.ndarray, initialize: bool) -> int:
        """Append rows for ``new_ids`` (unique, none known); returns the first new row index."""
        start, count = self._size, len(new_ids)
        self._reserve(start + count)
        self._ids[start : start + count] = new_ids
        if initialize:
            self._values[start : start + count] = self._fresh_rows(count)
        for name, slot in self._slots.items():
            slot[start : start + count] = self._slot_initial[name]
        self._index.update(zip(new_ids.tolist(), range(start, start + count), strict=True))
        self._size = start + count
        return start

    def _reserve(self, size: int) -> None:
        capacity = len(self._ids)
        if size <= capacity:
            return
        while capacity < size:
            capacity *= 2
        self._ids = _grow(self._ids, capacity)
        self._values = _grow(self._values, capacity)
        self._slots = {name: _grow(slot, capacity) for name, slot in self._slots.items()}


def _grow(array: np.ndarray, capacity: int) -> np.ndarray:
    grown = np.empty((capacity, *array.shape[1:]), dtype=array.dtype)
    grown[: len(array)] = array
    return grown
