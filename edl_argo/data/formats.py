"""``edl-argo data inspect`` and ``data seal`` of datasets in any format but RecordIO (whose own checks are
in :mod:`edl_argo.data.commands`).

**Inspect** opens the dataset as a job would (:func:`~edl_argo.readers.open_data`: listed, indexed,
pinned), prints its format, its shards with their record counts (the first :data:`SHOWN_SHARDS` and a
summary when there are more), the total and the schema, then, for file formats, reads every record of
every shard through the format's reader in ranges of :data:`VERIFY_RECORDS` (with a progress bar), so
that a bad CSV value or a TFRecord checksum error fails here, one line naming the file and line or
record. A sealed folder's files are also checked against its manifest's sizes and SHA-256.

**Seal** writes the manifest (:class:`~edl_argo.recordio.dataset.DatasetManifest` with ``data_format``)
of a folder of TFRecord, CSV or Parquet files, in place, after reading every record as inspect does: per
file its key, records, bytes and SHA-256 (of the version read). From then on every reader of that format
takes exactly those files (:func:`edl_argo.readers.files.list_data_files`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.progress import ProgressReporter
from edl_argo.readers import OpenedDataset
from edl_argo.readers.base import num_records
from edl_argo.readers.files import PinnedFiles
from edl_argo.recordio.dataset import MANIFEST_NAME, DatasetManifest, ShardEntry
from edl_argo.storage import Storage, open_storage
from edl_argo.storage.versions import utc_now

#: Formats whose records are read through by inspect (not a database: its rows are counted).
VERIFIED_FORMATS = ("tfrecord", "csv", "parquet", "images")
#: Formats whose shards are files, one each: the ones ``data seal`` seals.
SEALABLE_FORMATS = ("tfrecord", "csv", "parquet")
#: Records read per range when verifying a shard.
VERIFY_RECORDS = 4096
#: Shards listed one per line; more are summarized.
SHOWN_SHARDS = 20
#: Bytes read at a time when a file is checksummed.
DIGEST_BLOCK_BYTES = 8 << 20


def verify_records(data: OpenedDataset, on_shard: Callable[[str, int], None] | None = None) -> int:
    """Read every record of every shard of ``data`` through its reader, in ranges of
    :data:`VERIFY_RECORDS` as tasks read them, with a progress bar; ``on_shard(key, records)`` after each
    shard. Returns the records read. A reader's DataFormatError (naming the file and line or record)
    propagates; a range that yields another count than asked is one naming the shard."""
    total = sum(data.records.values())
    progress = ProgressReporter(f"verifying {data.describe()}", unit="record")
    done = 0
    try:
        progress.update(0, total)
        for shard in data.shards:
            for start in range(0, shard.records, VERIFY_RECORDS):
                end = min(start + VERIFY_RECORDS, shard.records)
                found = num_records(data.read(shard.key, start, end))
                if found != end - start:
                    raise DataFormatError(
                        f"{data.describe(shard.key)}: records {start}-{end - 1} asked for, {found} read"
                    )
                done += found
                progress.update(done, total)
            if on_shard is not None:
                on_shard(shard.key, shard.records)
    finally:
        progress.close()
    return done


def file_digest(files: PinnedFiles, key: str, version: str) -> tuple[int, str]:
    """``(bytes, sha256)`` of file ``key`` in ``version`` (ShardChangedError if it was replaced)."""
    size = files.size(key, version)
    digest = hashlib.sha256()
    for offset in range(0, size, DIGEST_BLOCK_BYTES):
        digest.update(files.read(key, offset, min(DIGEST_BLOCK_BYTES, size - offset), version))
    return size, digest.hexdigest()


def describe_schema(data: OpenedDataset) -> str:
    if not data.schema.columns:
        return "serialized records (one string per record, as feed parses them)"
    return ", ".join(f"{column.name} {column.dtype}" for column in data.schema.columns)


def inspect_data(data: OpenedDataset, url: str) -> None:
    """Print ``data``'s format, shards, total and schema, verifying every record of a file format and a
    sealed folder's files against its manifest (see the module docstring). Raises DataFormatError naming
    the file (and line or record) at fault."""
    print(f"format: {data.format}")
    print(f"{'shard':<48} {'records':>9}")
    shown = 0

    def show(key: str, records: int) -> None:
        nonlocal shown
        shown += 1
        if shown <= SHOWN_SHARDS:
            print(f"{data.names.get(key, key):<48} {records:>9}")

    verified = data.format in VERIFIED_FORMATS
    if verified:
        verify_records(data, show)
    else:
        for shard in data.shards:
            show(shard.key, shard.records)
    counts = list(data.records.values())
    if len(counts) > SHOWN_SHARDS:
        print(
            f"... {len(counts) - SHOWN_SHARDS} more shards (records per shard: min {min(counts)}, max "
            f"{max(counts)}, mean {sum(counts) / len(counts):.1f})"
        )
    label = f"total ({len(counts)} shards)"
    print(f"{label:<48} {sum(counts):>9}  {'ok' if verified else 'counted'}")
    print(f"schema: {describe_schema(data)}")
    if data.format in SEALABLE_FORMATS:
        _check_seal(data, url)


def _check_seal(data: OpenedDataset, url: str) -> None:
    """A sealed folder's files against its manifest's SHA-256 (their names and sizes were checked when
    it was opened); else a line saying how to seal it."""
    storage = open_storage(data.spec.url)
    if not storage.exists(MANIFEST_NAME):
        print(
            f"not sealed: {storage.describe()} has no manifest {MANIFEST_NAME}; `edl-argo data seal "
            f"{url}` checksums its files and writes one, so that jobs read exactly these files"
        )
        return
    manifest = DatasetManifest.from_bytes(storage.read(MANIFEST_NAME), url=storage.describe(MANIFEST_NAME))
    files = PinnedFiles(data.spec.url)
    for entry in manifest.shards:
        size, sha256 = file_digest(files, entry.key, data.versions.get(entry.key, ""))
        if (size, sha256) != (entry.bytes, entry.sha256) or data.records.get(entry.key) != entry.records:
            raise DataFormatError(
                f"file {files.describe(entry.key)} does not match the folder's manifest: it holds "
                f"{data.records.get(entry.key)} records, {size} bytes, sha256 {sha256}; the manifest says "
                f"{entry.records}, {entry.bytes}, {entry.sha256}"
            )
    print(f"sealed: every file matches the manifest {storage.describe(MANIFEST_NAME)}")


def refuse_sealed(storage: Storage) -> None:
    """ConfigError if the folder of ``storage`` holds a dataset manifest (anywhere below it)."""
    manifests = [info.key for info in storage.list("") if info.key.rpartition("/")[2] == MANIFEST_NAME]
    if manifests:
        raise ConfigError(
            f"{storage.describe()}: {storage.describe(manifests[0])} is a dataset manifest already; seal "
            "only a folder of data files without one"
        )


def seal_files(data: OpenedDataset, url: str) -> DatasetManifest:
    """Verify every record of ``data`` (a folder of files of a :data:`SEALABLE_FORMATS` format, opened
    without a manifest) and write its manifest, naming each file with its records, bytes and SHA-256.
    ConfigError for another format or a URL naming one file."""
    if data.format not in SEALABLE_FORMATS:
        raise ConfigError(
            f"{url}: {data.format} data cannot be sealed; `edl-argo data seal` seals folders of RecordIO, "
            f"{', '.join(SEALABLE_FORMATS)} files"
        )
    if data.spec.url.rstrip("/") != url.rstrip("/"):
        raise ConfigError(f"{url}: one file; seal the folder that holds the dataset's files")
    verify_records(data)
    files = PinnedFiles(data.spec.url)
    entries = []
    for shard in data.shards:
        size, sha256 = file_digest(files, shard.key, shard.version)
        entries.append(ShardEntry(shard.key, shard.records, size, sha256))
    manifest = DatasetManifest(tuple(entries), utc_now(), data.format)
    files.storage.write(MANIFEST_NAME, manifest.to_bytes())
    return manifest
