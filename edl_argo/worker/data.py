"""From a task's record range to the batches a model consumes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from edl_argo.model import Mode, ModelSpec
from edl_argo.recordio import ShardReader
from edl_argo.storage import Storage, open_storage


class RecordSource:
    """Reads record ranges of shards, one ranged read per range, caching storages and shard indexes.

    A shard read with a ``version`` (the one the master pinned, sent with the task) is read only in that
    version: :class:`~edl_argo.recordio.ShardChangedError` names it if it was replaced since.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._storages: dict[str, Storage] = {}
        self._readers: dict[tuple[str, str, str], ShardReader] = {}

    def reader(self, data_url: str, shard: str, version: str = "") -> ShardReader:
        with self._lock:
            key = (data_url, shard, version)
            if key not in self._readers:
                if data_url not in self._storages:
                    self._storages[data_url] = open_storage(data_url)
                storage = self._storages[data_url]
                self._readers[key] = ShardReader(storage, shard, version=version or None)
            return self._readers[key]

    def read(self, data_url: str, shard: str, start: int, end: int, version: str = "") -> list[bytes]:
        return self.reader(data_url, shard, version).read(start, end)


def make_batches(
    spec: ModelSpec, records: list[bytes], mode: str, minibatch_size: int, metadata: Any = None
) -> tf.data.Dataset:
    """Records → ``feed(dataset, mode, metadata)`` → batches of ``minibatch_size``."""
    dataset = tf.data.Dataset.from_tensor_slices(tf.constant(records, dtype=tf.string))
    dataset = spec.feed(dataset, mode, metadata)
    return dataset.batch(minibatch_size).prefetch(1)


def stream_batches(
    spec: ModelSpec,
    tasks: Callable[[], Iterator[tuple[int, Any]]],
    minibatch_size: int,
    metadata: Any = None,
) -> tf.data.Dataset:
    """One training input pipeline for a whole job: ``tasks()`` yields ``(seq, records)`` per task; each
    task's records go through ``feed(dataset, TRAINING, metadata)`` (traced once, for every task) and are
    batched on their own, so that no minibatch holds records of two tasks.

    Elements are ``(seq, item)``: ``item`` (a :class:`tf.experimental.Optional`) holds a minibatch of task
    ``seq``, or nothing after a task's last minibatch. Maps run in parallel (tf.data's map parallelization)
    and minibatches are prefetched (autotuned), across task boundaries.
    """
    tasks_dataset = tf.data.Dataset.from_generator(
        tasks,
        output_signature=(tf.TensorSpec([], tf.int64), tf.TensorSpec([None], tf.string)),
    )

    def task_batches(seq: tf.Tensor, records: tf.Tensor) -> tf.data.Dataset:
        fed = spec.feed(tf.data.Dataset.from_tensor_slices(records), Mode.TRAINING, metadata)
        batches = fed.batch(minibatch_size)
        end = tf.experimental.Optional.empty(batches.element_spec)
        return batches.map(lambda *batch: (seq, tf.experimental.Optional.from_value(batch))).concatenate(
            tf.data.Dataset.from_tensors((seq, end))
        )

    options = tf.data.Options()
    options.experimental_optimization.map_parallelization = True
    options.deterministic = True
    return tasks_dataset.flat_map(task_batches).with_options(options).prefetch(tf.data.AUTOTUNE)
