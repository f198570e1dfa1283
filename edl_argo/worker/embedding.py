"""Keras ``Embedding`` layers whose rows live on the parameter servers.

:func:`bind_embeddings` re-routes each ``keras.layers.Embedding`` of a model: instead of reading its local
(whole) table, a lookup takes the batch's unique ids, pulls just those rows from the PS (a
``tf.py_function``, so it also works inside ``tf.function``) and gathers from them. While a
:class:`SparseGradientTape` is active, the pulled rows are watched, so the step gets a gradient per pulled
row — an indexed-slices update for the PS — and never a gradient of the whole table.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import keras
import numpy as np
import tensorflow as tf

#: ``pull(table_name, unique_ids) -> rows``: fetch rows from the parameter servers.
PullRows = Callable[[str, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class EmbeddingTableSpec:
    """What a PS needs to create the rows of one table lazily."""

    name: str
    dim: int
    dtype: str
    initializer: str  # JSON of keras.initializers.serialize(...)


@dataclass
class _Lookup:
    table: str
    ids: tf.Tensor
    rows: tf.Tensor


@dataclass
class SparseGradientTape:
    """Collects the rows pulled during one forward pass so their gradients can be taken.

    Use inside the step function::

        with tape_scope.recording(tape):
            loss = ...
        rows = tape_scope.rows()
    """

    _tape: tf.GradientTape | None = None
    lookups: list[_Lookup] = field(default_factory=list)

    def start(self, tape: tf.GradientTape) -> None:
        self._tape = tape
        self.lookups = []

    def stop(self) -> None:
        self._tape = None

    def record(self, table: str, ids: tf.Tensor, rows: tf.Tensor) -> None:
        if self._tape is not None:
            self._tape.watch(rows)
            self.lookups.append(_Lookup(table, ids, rows))


def embedding_layers(model: keras.Model) -> list[keras.layers.Embedding]:
    """Every ``Embedding`` layer of the model, nested ones included, in a stable order."""
    return [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.Embedding)]


def table_specs(model: keras.Model) -> list[EmbeddingTableSpec]:
    return [
        EmbeddingTableSpec(
            name=layer.embeddings.path,
            dim=int(layer.output_dim),
            dtype=str(layer.embeddings.dtype),
            initializer=json.dumps(keras.initializers.serialize(layer.embeddings_initializer)),
        )
        for layer in embedding_layers(model)
    ]


def embedding_variable_paths(model: keras.Model) -> set[str]:
    return {layer.embeddings.path for layer in embedding_layers(model)}


def bind_embeddings(model: keras.Model, pull: PullRows, tape: SparseGradientTape) -> None:
    """Make every ``Embedding`` layer of ``model`` look its rows up through ``pull``."""
    for layer in embedding_layers(model):
        layer.call = types.MethodType(
            _remote_lookup(layer.embeddings.path, int(layer.output_dim), pull, tape), layer
        )


def _remote_lookup(
    table: str, dim: int, pull: PullRows, tape: SparseGradientTape
) -> Callable[[keras.layers.Embedding, tf.Tensor], tf.Tensor]:
    def fetch(unique_ids: tf.Tensor) -> np.ndarray:
        return pull(table, unique_ids.numpy())

    def call(layer: keras.layers.Embedding, inputs: tf.Tensor) -> tf.Tensor:
        ids = tf.cast(inputs, tf.int64)
        unique_ids, positions = tf.unique(tf.reshape(ids, [-1]))
        rows = tf.py_function(fetch, [unique_ids], Tout=layer.embeddings.dtype)
        rows = tf.ensure_shape(rows, [None, dim])
        tape.record(table, unique_ids, rows)
        gathered = tf.gather(rows, positions)
        outputs = tf.reshape(gathered, tf.concat([tf.shape(ids), [dim]], axis=0))
        outputs.set_shape(ids.shape.concatenate([dim]))
        return outputs

    return call
