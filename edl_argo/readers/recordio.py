"""RecordIO datasets (:mod:`edl_argo.recordio`): shards named by a manifest, each with its chunk index."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from edl_argo.errors import ConfigError
from edl_argo.readers.base import (
    DataFormat,
    OpenedDataset,
    RangeReader,
    ReaderSpec,
    Records,
    ShardInfo,
    serialized_records,
)
from edl_argo.recordio import MANIFEST_NAME, ShardReader, open_dataset
from edl_argo.recordio.dataset import Dataset
from edl_argo.recordio.index import INDEX_SUFFIX
from edl_argo.storage import Storage, open_storage


class RecordIOReader(RangeReader):
    """One :class:`ShardReader` per shard and pinned version, each loading its index once."""

    def __init__(self, spec: ReaderSpec, storage: Storage | None = None) -> None:
        super().__init__(spec)
        self._storage = storage or open_storage(spec.url)
        self._lock = threading.Lock()
        self._readers: dict[tuple[str, str], ShardReader] = {}

    def shard_reader(self, shard: str, version: str = "") -> ShardReader:
        with self._lock:
            if (shard, version) not in self._readers:
                self._readers[shard, version] = ShardReader(self._storage, shard, version=version or None)
            return self._readers[shard, version]

    def read(self, shard: str, start: int, end: int, *, version: str = "", hint: str = "") -> Records:
        return serialized_records(self.shard_reader(shard, version).read(start, end))


class OpenedRecordIO(OpenedDataset):
    def __init__(self, spec: ReaderSpec, dataset: Dataset) -> None:
        super().__init__(
            spec,
            [ShardInfo(key, count, dataset.versions[key]) for key, count in dataset.records.items()],
            RecordIOReader(spec, dataset.storage),
        )
        self.dataset = dataset

    @property
    def names(self) -> dict[str, str]:
        return self.dataset.names

    def describe(self, shard: str = "") -> str:
        return self.dataset.storage.describe(shard)


class RecordIOFormat(DataFormat):
    name = "recordio"

    def open(self, url: str, options: dict[str, Any], what: str = "") -> OpenedDataset:
        dataset = open_dataset(open_storage(url), what=what)
        if dataset.manifest.data_format != self.name:
            label = f"{what} {url}" if what else url
            raise ConfigError(
                f"{label}: its manifest {MANIFEST_NAME} is of {dataset.manifest.data_format} data, not "
                f"RecordIO (drop --data-format, or pass --data-format {dataset.manifest.data_format})"
            )
        return OpenedRecordIO(ReaderSpec(self.name, url), dataset)

    def range_reader(self, spec: ReaderSpec) -> RangeReader:
        return RecordIOReader(spec)

    def detect(self, url: str, names: Sequence[str]) -> bool:
        return MANIFEST_NAME in names or any(
            name.endswith(".rio") or ("." not in name.rsplit("/", 1)[-1] and not name.endswith(INDEX_SUFFIX))
            for name in names
        )
