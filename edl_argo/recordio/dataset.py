"""A dataset: RecordIO shards plus a manifest, written last, that names exactly them.

Layout of the dataset at a URL (a folder or ``s3://bucket/prefix``)::

    URL/_edl-dataset.json                       the manifest: written last, in one atomic write
    URL/v-20261125T143900Z-1a2b3c4d/data-00000  the shards of one written version, each with
    URL/v-20261125T143900Z-1a2b3c4d/data-00000.edl-index   its index sidecar

The manifest is JSON::

    {"format": "edl-argo-dataset", "version": 1, "created": "2026-11-25T14:39:00Z", "records": 1437,
     "shards": [{"key": "v-.../data-00000", "records": 360, "bytes": 9876, "sha256": "..."}, ...]}

``key`` is relative to the dataset URL; ``bytes`` and ``sha256`` are the shard file's size and SHA-256.
A manifest of files of another format (``edl-argo data seal`` of TFRecord, CSV or Parquet files) also has
``"data_format": "csv"`` (etc.); its shards are those files, and readers of that format take exactly them
(:func:`edl_argo.readers.files.list_data_files`). RecordIO manifests leave the field out.

**Readers** (:func:`open_dataset`) take the shards the manifest names and nothing else: a folder without a
manifest is not a dataset (its writing did not finish, or it was made by something else:
``edl-argo data seal`` writes a manifest for RecordIO shards made elsewhere). Every named shard must exist
with the size the manifest gives; the version of each (:attr:`ObjectInfo.version`) is pinned then, so a
reader can refuse a shard that is replaced while it reads.

**Writers** (:class:`DatasetWriter`) put a new dataset's shards into a fresh version folder ``v-<time>-<hex>``
and then write the manifest, which is the single switch from the previous dataset (if any) to the new one;
only then are the previous manifest's shards deleted. So a reader sees the old dataset or the new one,
never a mixture, and a writer that fails or is killed leaves the previous dataset (or nothing) in place.
A writer deletes nothing but the shards the previous manifest named, and version folders (their shards,
by name) that no manifest names any more: those left by a writer killed part-way. Two writers of one
dataset must not run at the same time.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from edl_argo.errors import ConfigError, DataFormatError, StorageError
from edl_argo.log import get_logger
from edl_argo.recordio.chunk import Compressor
from edl_argo.recordio.index import INDEX_SUFFIX
from edl_argo.recordio.writer import DEFAULT_MAX_CHUNK_BYTES, RecordIOWriter
from edl_argo.storage.base import ObjectInfo, ObjectNotFoundError, Storage, join_url, normalize_key
from edl_argo.storage.versions import VERSION_FOLDER, new_version_folder, objects_by_version, utc_now

log = get_logger(__name__)

#: The manifest's name in the dataset's folder.
MANIFEST_NAME = "_edl-dataset.json"
MANIFEST_FORMAT = "edl-argo-dataset"
MANIFEST_VERSION = 1
_SHARD_NAME = re.compile(r"^data-\d{5}(" + re.escape(INDEX_SUFFIX) + r")?$")

#: What readers are told to do about a folder of shards without a manifest.
REGENERATE_HINT = (
    "write it again with `edl-argo data digits|ctr|convert ... --overwrite`, or, for RecordIO shards made "
    "elsewhere, write their manifest with `edl-argo data seal URL`"
)


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest names it; ``key`` is relative to the dataset's URL."""

    key: str
    records: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class DatasetManifest:
    """The complete list of a dataset's shards (see the module docstring for the JSON form)."""

    shards: tuple[ShardEntry, ...]
    created: str = ""
    #: The format of the shards (a ``--data-format`` name); ``"recordio"`` is left out of the JSON.
    data_format: str = "recordio"

    @property
    def records(self) -> int:
        return sum(shard.records for shard in self.shards)

    def to_bytes(self) -> bytes:
        document = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "created": self.created,
            "records": self.records,
            "shards": [vars(shard) for shard in self.shards],
        }
        if self.data_format != "recordio":
            document["data_format"] = self.data_format
        return (json.dumps(document, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, url: str) -> DatasetManifest:
        """Parse and check a manifest; DataFormatError naming ``url`` and what is wrong."""

        def bad(detail: str) -> DataFormatError:
            return DataFormatError(f"dataset manifest {url} is invalid: {detail}; {REGENERATE_HINT}")

        try:
            document = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise bad(f"not JSON ({error})") from None
        if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
            raise bad(f'no "format": "{MANIFEST_FORMAT}"')
        if document.get("version") != MANIFEST_VERSION:
            raise bad(f"version {document.get('version')!r}, this edl-argo reads {MANIFEST_VERSION}")
        raw = document.get("shards")
        if not isinstance(raw, list) or not raw:
            raise bad("it names no shards")
        shards = []
        for number, item in enumerate(raw):
            try:
                shard = ShardEntry(
                    key=normalize_key(item["key"], allow_empty=False),
                    records=_count(item["records"]),
                    bytes=_count(item["bytes"]),
                    sha256=str(item["sha256"]),
                )
            except (KeyError, TypeError, ValueError, StorageError) as error:
                raise bad(f"shard entry {number}: {type(error).__name__} {error}") from None
            if shard.key.endswith(INDEX_SUFFIX) or posixpath.basename(shard.key) == MANIFEST_NAME:
                raise bad(f"shard entry {number} names {shard.key!r}, which is not a shard")
            shards.append(shard)
        duplicates = sorted({s.key for s in shards if [t.key for t in shards].count(s.key) > 1})
        if duplicates:
            raise bad(f"shards named twice: {', '.join(duplicates)}")
        data_format = document.get("data_format", "recordio")
        if not isinstance(data_format, str) or not data_format:
            raise bad(f'"data_format" {data_format!r} is not a format name')
        manifest = cls(tuple(shards), str(document.get("created", "")), data_format)
        if document.get("records") != manifest.records:
            raise bad(f'"records" is {document.get("records")!r} but its shards hold {manifest.records}')
        return manifest


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def manifest_key(prefix: str = "") -> str:
    """The manifest's key for the dataset at ``prefix`` of a storage."""
    return join_url(normalize_key(prefix), MANIFEST_NAME)


def _label(storage: Storage, prefix: str, what: str) -> str:
    url = storage.describe(normalize_key(prefix))
    return f"{what} {url}" if what else url


def read_manifest(storage: Storage, prefix: str = "", what: str = "") -> DatasetManifest:
    """The manifest of the dataset at ``prefix``. DataFormatError naming the dataset (``what`` is the flag
    that gave it, for messages) if there is none, or if it is invalid."""
    key = manifest_key(prefix)
    try:
        data = storage.read(key)
    except ObjectNotFoundError:
        folder = normalize_key(prefix, allow_empty=True)
        if not storage.list(folder + "/" if folder else ""):
            raise DataFormatError(
                f"{_label(storage, prefix, what)}: no data there, nothing below it (a RecordIO dataset is "
                f"the folder of its shards and {MANIFEST_NAME}); check the path"
            ) from None
        raise DataFormatError(
            f"{_label(storage, prefix, what)}: not a complete dataset, it has no manifest {MANIFEST_NAME} "
            f"(written last, once every shard is written); {REGENERATE_HINT}"
        ) from None
    return DatasetManifest.from_bytes(data, url=storage.describe(key))


@dataclass(frozen=True)
class Dataset:
    """A dataset opened for reading: its manifest and the pinned version of each shard."""

    storage: Storage
    prefix: str
    manifest: DatasetManifest
    #: Storage key (below ``storage``) -> the version pinned when the dataset was opened.
    versions: dict[str, str]

    @property
    def records(self) -> dict[str, int]:
        """Storage key of each shard -> its record count, in manifest order."""
        return {self.key(s): s.records for s in self.manifest.shards}

    def key(self, shard: ShardEntry) -> str:
        """The storage key of ``shard``."""
        return join_url(self.prefix, shard.key)

    @property
    def names(self) -> dict[str, str]:
        """Storage key of each shard -> its name in the dataset: its manifest key without the version
        folder (``data-00000``), the same whichever version of the dataset is read."""
        return {self.key(s): shard_name(s.key) for s in self.manifest.shards}


def shard_name(key: str) -> str:
    """A manifest key without its leading version folder, if it has one."""
    folder, _, rest = key.partition("/")
    return rest if rest and VERSION_FOLDER.match(folder) else key


def open_dataset(storage: Storage, prefix: str = "", what: str = "") -> Dataset:
    """Read the manifest of the dataset at ``prefix``, check that every shard it names is there with its
    size, and pin each shard's version. DataFormatError naming the dataset and the missing or changed
    shard otherwise."""
    prefix = normalize_key(prefix)
    manifest = read_manifest(storage, prefix, what)
    found: dict[str, ObjectInfo] = {}
    for folder in sorted({posixpath.dirname(join_url(prefix, s.key)) for s in manifest.shards}):
        found.update((info.key, info) for info in storage.list(folder + "/" if folder else ""))
    versions = {}
    for shard in manifest.shards:
        key = join_url(prefix, shard.key)
        info = found.get(key)
        if info is None:
            raise DataFormatError(
                f"{_label(storage, prefix, what)}: shard {storage.describe(key)} named by its manifest is "
                f"missing; {REGENERATE_HINT}"
            )
        if info.size != shard.bytes:
            raise DataFormatError(
                f"{_label(storage, prefix, what)}: shard {storage.describe(key)} has {info.size} bytes, its "
                f"manifest says {shard.bytes} (it changed after the dataset was written); {REGENERATE_HINT}"
            )
        versions[key] = info.version
    return Dataset(storage, prefix, manifest, versions)


class DatasetWriter:
    """Writes a new dataset at ``prefix`` of ``storage``, shard by shard, published by :meth:`commit`.

    Construction refuses (ConfigError) a prefix that already holds a dataset unless ``overwrite``, and
    removes version folders that no manifest names (a killed writer's leftovers). :meth:`write_shard`
    streams records into a local temporary file, so memory does not grow with the shard. Used as a
    context manager, a writer that is left by an exception before :meth:`commit` deletes what it wrote.
    """

    def __init__(
        self,
        storage: Storage,
        prefix: str = "",
        *,
        overwrite: bool,
        compressor: Compressor = Compressor.SNAPPY,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    ) -> None:
        self.storage = storage
        self.prefix = normalize_key(prefix)
        self.compressor = compressor
        self.max_chunk_bytes = max_chunk_bytes
        self.previous = self._previous(overwrite)
        self._remove_abandoned_versions()
        self.version_folder = new_version_folder()
        self._entries: list[ShardEntry] = []
        self._written: list[str] = []
        self._committed = False

    @property
    def url(self) -> str:
        return self.storage.describe(self.prefix)

    def _previous(self, overwrite: bool) -> DatasetManifest | None:
        """The manifest this writer replaces: None if none (or it is unreadable and ``overwrite``)."""
        if not self.storage.exists(manifest_key(self.prefix)):
            return None
        try:
            previous = read_manifest(self.storage, self.prefix)
        except DataFormatError as error:
            if not overwrite:
                raise ConfigError(f"{error}; pass --overwrite to replace it") from None
            log.warning("dataset_manifest_unreadable", url=self.url, error=str(error))
            return None
        if not overwrite:
            raise ConfigError(
                f"{self.url} already holds a dataset ({len(previous.shards)} shards, {previous.records} "
                "records); pass --overwrite to replace it"
            )
        return previous

    def _remove_abandoned_versions(self) -> None:
        """Delete the shards of version folders that the current manifest does not name."""
        current = {s.key.split("/", 1)[0] for s in self.previous.shards} if self.previous else set()
        for folder, infos in objects_by_version(self.storage, self.prefix).items():
            for info in infos:
                parent, _, name = info.key.rpartition("/")
                if folder not in current and parent.endswith(folder) and _SHARD_NAME.match(name):
                    self.storage.delete(info.key)
                    log.info("abandoned_shard_removed", url=self.storage.describe(info.key))

    def write_shard(self, records: Iterable[bytes]) -> ShardEntry:
        """Write ``records`` as the next shard (and its index sidecar) of the new version."""
        if self._committed:
            raise ValueError("write_shard() after commit()")
        rel = f"{self.version_folder}/data-{len(self._entries):05d}"
        key = join_url(self.prefix, rel)
        with tempfile.TemporaryDirectory(prefix="edl-shard-") as tmp:
            path = Path(tmp) / "shard"
            digest = hashlib.sha256()
            with path.open("wb") as file:
                writer = RecordIOWriter(_Hashing(file, digest), self.compressor, self.max_chunk_bytes)
                for record in records:
                    writer.write(record)
                index = writer.close()
            self._written += [key, key + INDEX_SUFFIX]
            self.storage.write_file(key, path)
        self.storage.write(key + INDEX_SUFFIX, index.to_bytes())
        entry = ShardEntry(rel, index.num_records, index.file_size, digest.hexdigest())
        self._entries.append(entry)
        log.info("shard_written", url=self.storage.describe(key), records=entry.records)
        return entry

    def commit(self) -> DatasetManifest:
        """Write the manifest (the switch to the new dataset), then delete the shards of the previous one."""
        if not self._entries:
            raise ValueError("a dataset needs at least one shard")
        created = utc_now()
        manifest = DatasetManifest(tuple(self._entries), created)
        self.storage.write(manifest_key(self.prefix), manifest.to_bytes())
        self._committed = True
        if self.previous is not None:
            kept = {s.key for s in manifest.shards}
            try:
                for shard in self.previous.shards:
                    if shard.key not in kept:
                        key = join_url(self.prefix, shard.key)
                        self.storage.delete(key)
                        self.storage.delete(key + INDEX_SUFFIX)
            except StorageError as error:  # the new dataset stands; the next write removes what is left
                log.warning("previous_shards_not_removed", url=self.url, error=str(error))
        log.info("dataset_written", url=self.url, shards=len(manifest.shards), records=manifest.records)
        return manifest

    def abort(self) -> None:
        """Delete what this writer wrote (best effort: a failing store leaves them to the next writer)."""
        for key in reversed(self._written):
            try:
                self.storage.delete(key)
            except StorageError as error:
                log.warning("dataset_cleanup_failed", url=self.storage.describe(key), error=str(error))
                return
        self._written = []

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is not None and not self._committed:
            self.abort()


class _Hashing:
    """A binary file that also feeds what is written to a hash."""

    def __init__(self, file: Any, digest: Any) -> None:
        self._file = file
        self._digest = digest

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        return self._file.write(data)


def seal_dataset(storage: Storage, prefix: str = "") -> DatasetManifest:
    """Write the manifest of RecordIO shards made elsewhere (every shard under ``prefix``, in place),
    after reading and checksumming each. ConfigError if there is a manifest already, or no shard."""
    from edl_argo.recordio import list_shards
    from edl_argo.recordio.reader import ShardReader

    prefix = normalize_key(prefix)
    base = prefix + "/" if prefix else ""
    manifests = [info.key for info in storage.list(base) if posixpath.basename(info.key) == MANIFEST_NAME]
    if manifests:
        raise ConfigError(
            f"{storage.describe(prefix)}: {storage.describe(manifests[0])} is a dataset manifest already; "
            "seal only a folder of RecordIO shards without one"
        )
    keys = list_shards(storage, base)
    if not keys:
        raise ConfigError(f"{storage.describe(prefix)}: no shards there to seal")
    entries = []
    for key in keys:
        summary = ShardReader(storage, key).verify()
        entries.append(ShardEntry(key[len(base) :], summary.records, summary.bytes, summary.sha256))
    manifest = DatasetManifest(tuple(entries), utc_now())
    storage.write(manifest_key(prefix), manifest.to_bytes())
    return manifest
