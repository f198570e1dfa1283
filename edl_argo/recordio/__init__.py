"""RecordIO: the chunked, checksummed record format of ElasticDL datasets.

Byte-compatible with the Go library ``github.com/wangkuiyi/recordio``. See ``docs/recordio.md`` for the
on-disk layout, the ``.edl-index`` sidecar and how a range of records is fetched with one ranged read.

A dataset is a set of shards named by a manifest written last (:mod:`edl_argo.recordio.dataset`).

Typical use::

    index = write_shard(storage, "train/shard-0000", records)
    reader = ShardReader(storage, "train/shard-0000")
    batch = reader.read(512, 1024)  # one ranged read
"""

from __future__ import annotations

import posixpath

from edl_argo.recordio.chunk import (
    HEADER_SIZE,
    MAGIC,
    ChunkHeader,
    Compressor,
    RecordIOError,
    decode_chunk,
    encode_chunk,
    parse_header,
)
from edl_argo.recordio.dataset import (
    MANIFEST_NAME,
    Dataset,
    DatasetManifest,
    DatasetWriter,
    ShardEntry,
    open_dataset,
    read_manifest,
    seal_dataset,
)
from edl_argo.recordio.index import INDEX_SUFFIX, ChunkEntry, ChunkIndex
from edl_argo.recordio.reader import ShardChangedError, ShardReader, ShardSummary
from edl_argo.recordio.writer import DEFAULT_MAX_CHUNK_BYTES, RecordIOWriter, write_shard
from edl_argo.storage.base import Storage

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "HEADER_SIZE",
    "INDEX_SUFFIX",
    "MAGIC",
    "MANIFEST_NAME",
    "ChunkEntry",
    "ChunkHeader",
    "ChunkIndex",
    "Compressor",
    "Dataset",
    "DatasetManifest",
    "DatasetWriter",
    "RecordIOError",
    "RecordIOWriter",
    "ShardChangedError",
    "ShardEntry",
    "ShardReader",
    "ShardSummary",
    "decode_chunk",
    "encode_chunk",
    "list_shards",
    "open_dataset",
    "parse_header",
    "read_manifest",
    "seal_dataset",
    "write_shard",
]


def list_shards(storage: Storage, prefix: str = "") -> list[str]:
    """Keys of the shards under ``prefix``, sorted.

    Every object is a shard except index sidecars (``*`` + :data:`INDEX_SUFFIX`) and objects whose base
    name starts with ``.`` or ``_`` (temporary files, ``_COMPLETE``-style markers).
    """
    return sorted(
        info.key
        for info in storage.list(prefix)
        if not info.key.endswith(INDEX_SUFFIX) and posixpath.basename(info.key)[:1] not in (".", "_")
    )
