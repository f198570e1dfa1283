"""Writing RecordIO shards (and their index sidecars)."""

from __future__ import annotations

import io
from collections.abc import Iterable
from types import TracebackType
from typing import BinaryIO

from edl_argo.recordio.chunk import Compressor, as_record, encode_chunk
from edl_argo.recordio.index import INDEX_SUFFIX, ChunkIndex
from edl_argo.storage.base import Storage

#: Default cap on a chunk's *uncompressed* payload (record bytes plus 4-byte length prefixes).
DEFAULT_MAX_CHUNK_BYTES = 1 << 20


class RecordIOWriter:
    """Stream records into a RecordIO file, one chunk at a time.

    Records are buffered until adding the next one would push the chunk's uncompressed payload (each
    record plus its 4-byte length prefix) past ``max_chunk_bytes``; then the chunk is compressed and
    written to ``fileobj``. A record larger than ``max_chunk_bytes`` gets a chunk of its own. Chunks are
    never empty, so a file with no records has no chunks (and zero bytes).

    :meth:`close` writes the last chunk and returns the :class:`ChunkIndex` of what was written; it
    does not close ``fileobj``, which stays the caller's. Used as a context manager, the writer is
    closed on normal exit only, so a failure never completes a half-written shard.
    """

    def __init__(
        self,
        fileobj: BinaryIO,
        compressor: Compressor = Compressor.SNAPPY,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    ) -> None:
        if max_chunk_bytes <= 0:
            raise ValueError(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
        self._file = fileobj
        self._compressor = Compressor(compressor)
        self._max_chunk_bytes = max_chunk_bytes
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._offset = 0
        self._layout: list[tuple[int, int, int, Compressor]] = []
        self._index: ChunkIndex | None = None
        #: Records written so far.
        self.num_records = 0

    def write(self, record: bytes) -> None:
        """Append one record (any bytes-like object, including ``b""``); ``TypeError`` for anything else."""
        if self._index is not None:
            raise ValueError("write() on a closed RecordIOWriter")
        record = as_record(record)  # a bytearray the caller may reuse is frozen now
        size = 4 + len(record)
        if self._pending and self._pending_bytes + size > self._max_chunk_bytes:
            self._flush_chunk()
        self._pending.append(record)
        self._pending_bytes += size
        self.num_records += 1

    def close(self) -> ChunkIndex:
        """Write the buffered chunk, if any, and return the index of the file. Idempotent."""
        if self._index is None:
            if self._pending:
                self._flush_chunk()
            self._index = ChunkIndex.from_layout(self._layout, self._offset)
        return self._index

    @property
    def index(self) -> ChunkIndex | None:
        """The file's index once :meth:`close` has run, else ``None``."""
        return self._index

    def _flush_chunk(self) -> None:
        data = encode_chunk(self._pending, self._compressor)
        self._file.write(data)
        self._layout.append((self._offset, len(data), len(self._pending), self._compressor))
        self._offset += len(data)
        self._pending = []
        self._pending_bytes = 0

    def __enter__(self) -> RecordIOWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()


def write_shard(
    storage: Storage,
    key: str,
    records: Iterable[bytes],
    compressor: Compressor = Compressor.SNAPPY,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> ChunkIndex:
    """Write ``records`` as the shard ``key`` plus its sidecar ``key + INDEX_SUFFIX``; return the index.

    The shard is encoded in memory and written with one atomic :meth:`Storage.write`. Order: any old
    sidecar is deleted, then the shard is written, then the new sidecar, so a sidecar never describes a
    missing shard or a different version of it. If the last step fails the shard is still readable (by
    scanning its headers).
    """
    buffer = io.BytesIO()
    with RecordIOWriter(buffer, compressor, max_chunk_bytes) as writer:
        for record in records:
            writer.write(record)
    index = writer.close()
    storage.delete(key + INDEX_SUFFIX)
    storage.write(key, buffer.getvalue())
    storage.write(key + INDEX_SUFFIX, index.to_bytes())
    return index
