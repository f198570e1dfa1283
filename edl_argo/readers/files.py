"""What file formats share: the files of a dataset URL (a folder, an S3 prefix or one file), their pinned
versions, reads of a pinned version, and a sparse record-offset index.

A file dataset's :attr:`ReaderSpec.url` is the *folder* its shard keys are relative to: the URL itself for
a folder or prefix, its parent for a single file. So a worker opens one storage per dataset, as for
RecordIO.

A folder sealed by ``edl-argo data seal`` holds a manifest (``_edl-dataset.json``, see
:mod:`edl_argo.recordio.dataset`) naming its files: :func:`list_data_files` then takes exactly those
files, each required to be there with the size the manifest gives, for every file format alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edl_argo.errors import ConfigError, DataFormatError, StorageError
from edl_argo.recordio.dataset import MANIFEST_NAME
from edl_argo.recordio.reader import ShardChangedError
from edl_argo.storage import Storage, open_storage
from edl_argo.storage.base import ObjectChangedError, ObjectInfo, ObjectNotFoundError

#: A sparse index keeps the position of every ``INDEX_STRIDE``-th record: a range starting between two
#: entries reads at most ``INDEX_STRIDE - 1`` records it skips.
INDEX_STRIDE = 64


@dataclass(frozen=True)
class DataFiles:
    """The files of a dataset URL: the storage of their folder, its URL, and each file (sorted by key)."""

    storage: Storage
    folder_url: str
    files: tuple[ObjectInfo, ...]


def _hidden(key: str) -> bool:
    return any(part[:1] in (".", "_") for part in key.split("/"))


def list_data_files(
    url: str, accept: Callable[[str], bool], what: str = "", data_format: str = ""
) -> DataFiles:
    """The files ``accept`` takes (by key) under the folder ``url``, or the one file ``url`` names.
    Hidden files (a path part starting with ``.`` or ``_``: markers, manifests, temporaries) are left out.
    ConfigError naming ``url`` (and ``what``, the flag) if there is none.

    A folder with a manifest (sealed) lists exactly the files it names (:func:`manifest_files`), in its
    order; ``data_format``, the caller's format name, must then be the manifest's."""
    label = f"{what} {url}" if what else url
    storage = open_storage(url)
    try:
        infos = storage.list("")
    except StorageError:
        infos = []
    if any(info.key == MANIFEST_NAME for info in infos):
        sealed = manifest_files(storage, infos, accept, label, data_format)
        return DataFiles(storage, url, sealed)
    files = sorted((i for i in infos if not _hidden(i.key) and accept(i.key)), key=lambda i: i.key)
    if files:
        return DataFiles(storage, url, tuple(files))
    parent, _, name = url.rstrip("/").rpartition("/")
    if name and parent and not infos:
        storage = open_storage(parent + "/" if parent.endswith(":/") else parent)
        try:
            info = storage.stat(name)
        except ObjectNotFoundError:
            info = None
        if info is not None:
            if not accept(name):
                raise ConfigError(f"{label}: not a file of this format (pass --data-format to say which)")
            return DataFiles(storage, parent, (info,))
    raise ConfigError(f"{label}: no data files there (a folder or S3 prefix of data files, or one file)")


#: What to do about a sealed folder whose files changed.
RESEAL_HINT = "put the file back, or delete the manifest and seal the folder again (`edl-argo data seal URL`)"


def manifest_files(
    storage: Storage,
    infos: Sequence[ObjectInfo],
    accept: Callable[[str], bool],
    label: str,
    data_format: str = "",
) -> tuple[ObjectInfo, ...]:
    """The files the manifest of ``storage``'s folder names, found among ``infos`` (its listing), each
    with its pinned version. DataFormatError (one line naming the file) for a named file that is missing,
    whose size differs from the manifest's, or that is not of ``accept``'s format; ConfigError if the
    manifest is of another format than ``data_format``."""
    from edl_argo.recordio.dataset import DatasetManifest

    manifest = DatasetManifest.from_bytes(storage.read(MANIFEST_NAME), url=storage.describe(MANIFEST_NAME))
    if data_format and manifest.data_format != data_format:
        raise ConfigError(
            f"{label}: its manifest {storage.describe(MANIFEST_NAME)} is of {manifest.data_format} data, not "
            f"{data_format} (drop --data-format, or pass --data-format {manifest.data_format})"
        )
    found = {info.key: info for info in infos}
    files = []
    for entry in manifest.shards:
        info = found.get(entry.key)
        if info is None:
            raise DataFormatError(
                f"{label}: file {storage.describe(entry.key)} named by its manifest is missing; {RESEAL_HINT}"
            )
        if info.size != entry.bytes:
            raise DataFormatError(
                f"{label}: file {storage.describe(entry.key)} has {info.size} bytes, its manifest says "
                f"{entry.bytes} (it changed after the folder was sealed); {RESEAL_HINT}"
            )
        if not accept(entry.key):
            raise DataFormatError(
                f"{label}: file {storage.describe(entry.key)} named by its manifest is not a "
                f"{manifest.data_format} file"
            )
        files.append(info)
    return tuple(files)


class PinnedFiles:
    """Reads of files of one folder, each in the version a task pinned (thread-safe, one storage)."""

    def __init__(self, folder_url: str) -> None:
        self.folder_url = folder_url
        self.storage = open_storage(folder_url)
        self._lock = threading.Lock()
        self._sizes: dict[tuple[str, str], int] = {}

    def describe(self, key: str) -> str:
        return self.storage.describe(key)

    def read(self, key: str, offset: int = 0, length: int | None = None, version: str = "") -> bytes:
        """Bytes ``[offset, offset + length)`` of ``key`` (to its end if ``length`` is None), in
        ``version`` if given: ShardChangedError naming the file if it was replaced."""
        try:
            if version:
                return self.storage.read_version(key, offset, length, version=version)
            return self.storage.read(key, offset, length)
        except ObjectChangedError:
            raise ShardChangedError(self.describe(key), version, self._current_version(key)) from None
        except ObjectNotFoundError:
            raise ShardChangedError(self.describe(key), version or "any", "") from None

    def _current_version(self, key: str) -> str:
        try:
            return self.storage.stat(key).version
        except ObjectNotFoundError:
            return ""

    def size(self, key: str, version: str = "") -> int:
        with self._lock:
            if (key, version) not in self._sizes:
                info = self.storage.stat(key)
                if version and info.version != version:
                    raise ShardChangedError(self.describe(key), version, info.version)
                self._sizes[key, version] = info.size
            return self._sizes[key, version]


@dataclass(frozen=True)
class RangeHint:
    """Where records ``[start, end)`` of a file lie: read bytes ``[offset, end_offset)`` (``end_offset``
    -1: to the end of the file), skip ``skip`` records there, take ``end - start``; ``line`` is the
    1-based line number at ``offset`` (text formats; 0 otherwise)."""

    offset: int
    end_offset: int
    skip: int
    line: int = 0

    def to_str(self) -> str:
        return f"{self.offset}:{self.end_offset}:{self.skip}:{self.line}"

    @classmethod
    def from_str(cls, text: str) -> RangeHint:
        offset, end_offset, skip, line = (int(part) for part in text.split(":"))
        return cls(offset, end_offset, skip, line)


class OffsetIndex:
    """A sparse index of one file: the byte offset (and line number) of every :data:`INDEX_STRIDE`-th
    record, the record count and the byte offset where the records end. Built by a format's scan."""

    def __init__(
        self,
        offsets: Sequence[int],
        records: int,
        end: int,
        lines: Sequence[int] | None = None,
        stride: int = INDEX_STRIDE,
    ) -> None:
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lines = np.asarray(lines if lines is not None else np.zeros(len(self.offsets)), dtype=np.int64)
        self.records = records
        self.end = end
        self.stride = stride
        expected = (records + stride - 1) // stride
        if len(self.offsets) != expected or len(self.lines) != expected:
            raise ValueError(f"{len(self.offsets)} index entries for {records} records at stride {stride}")

    def locate(self, start: int, end: int) -> RangeHint:
        if not 0 <= start <= end <= self.records:
            raise ValueError(f"records [{start}, {end}) outside [0, {self.records})")
        if start == self.records:
            return RangeHint(self.end, self.end, 0)
        entry = start // self.stride
        after = -(-end // self.stride)
        end_offset = int(self.offsets[after]) if after < len(self.offsets) else self.end
        return RangeHint(
            int(self.offsets[entry]), end_offset, start - entry * self.stride, int(self.lines[entry])
        )
