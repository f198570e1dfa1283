"""From a task's record range to the batches a model consumes."""

from __future__ import annotations

import threading
from typing import Any

import tensorflow as tf

from edl_argo.model import ModelSpec
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
