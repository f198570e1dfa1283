"""A model's outputs and labels as named numpy arrays, whatever structure the model or ``feed`` returns.

Keras models return one tensor, a list (or tuple) of tensors, or a dict of them; ``feed`` may return labels
as one tensor or a dict. Evaluation and prediction handle all of them through one form, ``{name: array}``
with one row per record:

* one tensor is named :data:`SINGLE` (``"output"``);
* a dict keeps its keys;
* a list takes the model's ``output_names`` (the names of a functional model's output layers) when they
  match in number, else ``output_0``, ``output_1``, ...

:func:`as_given` turns the form back into what metrics expect: the array itself for a single tensor, else
the dict.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from edl_argo.json_values import dumps

__all__ = [
    "SINGLE",
    "as_given",
    "concatenate",
    "named_arrays",
    "num_records",
    "output_names",
    "prediction_lines",
]

#: The name of a model's output (or of the labels) when it is one tensor.
SINGLE = "output"


def output_names(model: Any) -> list[str] | None:
    """The names a functional Keras model gives its outputs, or None."""
    names = getattr(model, "output_names", None)
    return [str(name) for name in names] if isinstance(names, list | tuple) else None


def named_arrays(structure: Any, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """``structure`` (a tensor, a list/tuple or a dict of tensors) as ``{name: numpy array}``.

    ``names`` names the items of a list (see the module docstring). ValueError for nesting deeper than one
    level or an array without a record dimension.
    """
    if isinstance(structure, Mapping):
        named = {str(key): value for key, value in structure.items()}
    elif isinstance(structure, list | tuple):
        keys = list(names) if names is not None and len(names) == len(structure) else None
        named = {(keys[i] if keys else f"output_{i}"): value for i, value in enumerate(structure)}
    else:
        named = {SINGLE: structure}
    arrays = {}
    for name, value in named.items():
        if isinstance(value, Mapping | list | tuple):
            raise ValueError(f"output {name!r} is itself a {type(value).__name__}: nest at most one level")
        array = np.asarray(value)
        if array.ndim == 0:
            raise ValueError(f"output {name!r} is a scalar, not one row per record")
        arrays[name] = array
    return arrays


def as_given(named: Mapping[str, np.ndarray]) -> np.ndarray | dict[str, np.ndarray]:
    """The single array if ``named`` holds just :data:`SINGLE`, else a plain dict of the arrays."""
    return named[SINGLE] if list(named) == [SINGLE] else dict(named)


def num_records(structure: Any) -> int:
    """Rows of a batch: the first dimension of its first tensor (a dict's first value, a list's first)."""
    while isinstance(structure, Mapping | list | tuple):
        if not structure:
            raise ValueError("an empty structure has no records")
        structure = next(iter(structure.values())) if isinstance(structure, Mapping) else structure[0]
    shape = getattr(structure, "shape", None)
    if shape is None:
        shape = np.shape(structure)
    if len(shape) == 0 or shape[0] is None:
        raise ValueError("a batch's tensors must have a record dimension")
    return int(shape[0])


def concatenate(batches: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Batches of one named form joined record-wise; ValueError if their names differ."""
    names = list(batches[0])
    if any(list(batch) != names for batch in batches):
        raise ValueError("batches name different outputs")
    return {name: np.concatenate([batch[name] for batch in batches]) for name in names}


def prediction_lines(shard: str, start: int, named: Mapping[str, np.ndarray]) -> Iterator[str]:
    """One JSON line per record, ``{"shard", "record", "output"}``, records numbered from ``start``.

    ``output`` is the record's row of a single-tensor output, or ``{name: row}`` for a multi-output model;
    NaN and infinite values are written as ``null``.
    """
    given = as_given(named)
    for i in range(len(next(iter(named.values())))):
        row = given[i] if isinstance(given, np.ndarray) else {name: array[i] for name, array in given.items()}
        yield dumps({"shard": shard, "record": start + i, "output": row})
