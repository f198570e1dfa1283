"""Keras ``Embedding`` layers whose rows live on the parameter servers.

:func:`bind_embeddings` re-routes every ``keras.layers.Embedding`` of a model through an
:class:`EmbeddingLookups`, which runs a forward pass in one of two modes:

* **collect**: each lookup records the unique ids it needs (in order of first appearance, as
  ``tf.unique`` gives them) and returns zeros. This cheap pass tells the worker, before the real step,
  every row the minibatch touches, so it can pull all of them with one call per parameter server.
* **feed**: each lookup takes its rows from the list passed to the step (one tensor per lookup, rows in
  the order of that lookup's unique ids) and gathers from them. While a ``tf.GradientTape`` is attached,
  the rows are watched, so the step yields one gradient row per pulled row — an indexed-slices update
  for the PS — and never a gradient of a whole table.

Both passes are traced into ``tf.function``\\ s; no Python runs per lookup at step time, and the local
(whole) tables of the Keras layers are never read.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import keras
import tensorflow as tf

from edl_argo.model.embedding_tables import embedding_layers


@dataclass
class EmbeddingLookups:
    """The lookups of one traced forward pass, and how they get their rows (see the module docstring).

    Lists are filled while a function is traced; lookups happen in the same order in every trace of one
    model, so ``tables`` (the table of each lookup) is the same for the collect and the feed pass.
    """

    mode: str = "feed"
    tables: list[str] = field(default_factory=list)
    unique_ids: list[tf.Tensor] = field(default_factory=list)
    rows: Sequence[tf.Tensor] = ()
    tape: tf.GradientTape | None = None
    #: Feed mode: the row tensors the lookups used, in lookup order; take the gradients of these.
    rows_used: list[tf.Tensor] = field(default_factory=list)
    #: Feed mode: each lookup's rows per position (gathered from its unique rows), in lookup order. Their
    #: gradients are the values of the ``IndexedSlices`` Keras's own ``Embedding`` would yield.
    positions_used: list[tf.Tensor] = field(default_factory=list)

    def start(self, mode: str, rows: Sequence[tf.Tensor] = (), tape: tf.GradientTape | None = None) -> None:
        self.mode, self.rows, self.tape = mode, rows, tape
        self.tables, self.unique_ids, self.rows_used, self.positions_used = [], [], [], []

    def lookup(self, table: str, dim: int, dtype: tf.DType, inputs: tf.Tensor) -> tf.Tensor:
        ids = tf.cast(inputs, tf.int64)
        unique_ids, positions = tf.unique(tf.reshape(ids, [-1]))
        index = len(self.tables)
        self.tables.append(table)
        self.unique_ids.append(unique_ids)
        if self.mode == "collect":
            rows = tf.zeros(tf.stack([tf.size(unique_ids), dim]), dtype=dtype)
        else:
            if index >= len(self.rows):
                raise RuntimeError(f"lookup {index} of table {table!r} has no rows; was collect run first?")
            rows = tf.ensure_shape(tf.convert_to_tensor(self.rows[index], dtype=dtype), [None, dim])
            if self.tape is not None:
                self.tape.watch(rows)
            self.rows_used.append(rows)
        gathered = tf.gather(rows, positions)
        if self.mode != "collect":
            self.positions_used.append(gathered)
        outputs = tf.reshape(gathered, tf.concat([tf.shape(ids), [dim]], axis=0))
        outputs.set_shape(ids.shape.concatenate([dim]))
        return outputs


def bind_embeddings(model: keras.Model, lookups: EmbeddingLookups) -> None:
    """Make every ``Embedding`` layer of ``model`` look its rows up through ``lookups``."""
    for layer in embedding_layers(model):
        layer.call = types.MethodType(_routed_call(layer, lookups), layer)


def _routed_call(
    layer: keras.layers.Embedding, lookups: EmbeddingLookups
) -> Callable[[keras.layers.Embedding, tf.Tensor], tf.Tensor]:
    table, dim, dtype = layer.embeddings.path, int(layer.output_dim), tf.as_dtype(layer.embeddings.dtype)

    def call(_layer: keras.layers.Embedding, inputs: tf.Tensor) -> tf.Tensor:
        return lookups.lookup(table, dim, dtype, inputs)

    return call
