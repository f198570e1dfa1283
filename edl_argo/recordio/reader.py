"""Reading RecordIO shards from a :class:`~edl_argo.storage.base.Storage`: random access and streaming."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from edl_argo.errors import DataFormatError
from edl_argo.log import get_logger
from edl_argo.recordio.chunk import RecordIOError, decode_chunk_at
from edl_argo.recordio.index import INDEX_SUFFIX, ChunkIndex
from edl_argo.storage.base import ObjectChangedError, ObjectInfo, ObjectNotFoundError, Storage

log = get_logger(__name__)

#: Sequential readers (:meth:`ShardReader.iter_records`, :meth:`ShardReader.verify`) fetch whole chunks
#: in pieces of about this many bytes (one piece is never smaller than one chunk).
SEQUENTIAL_READ_BYTES = 16 << 20


class ShardChangedError(DataFormatError):
    """A shard is no longer the version pinned when its dataset was opened: it was replaced or deleted
    while a job read it."""

    def __init__(self, url: str, pinned: str, found: str) -> None:
        now = f"now version {found}" if found else "now it is gone"
        super().__init__(
            f"shard {url} changed while this job was reading it (pinned version {pinned}, {now}); a dataset "
            "must not be replaced while a job reads it: run the job again"
        )
        self.url = url


@dataclass(frozen=True)
class ShardSummary:
    """What :meth:`ShardReader.verify` found in a healthy shard."""

    key: str
    records: int
    chunks: int
    #: Size of the shard in bytes.
    bytes: int
    #: Number of chunks per compressor label, e.g. ``{"snappy": 12}``.
    compressors: dict[str, int]
    #: SHA-256 of the shard's bytes (hex), as a dataset manifest records it.
    sha256: str = ""


class ShardReader:
    """Read records of one RecordIO shard stored at ``key``.

    The index comes from, in order: the ``index`` argument (trusted as is, no I/O); the sidecar
    ``key + INDEX_SUFFIX`` if it parses and describes a file of the shard's current size; otherwise a scan
    of the chunk headers (one small ranged read per chunk). A missing, stale or corrupt sidecar is only
    logged: the shard's own headers and checksums are the source of truth, the sidecar a cache. The index
    is loaded once, in the constructor, so afterwards :meth:`read` costs exactly one storage call.

    Every chunk read is fully validated (magic, checksum, decompression, record count, agreement with the
    index); problems raise :class:`RecordIOError` naming the shard URL, chunk number and byte offset.

    With ``version`` (an :attr:`~edl_argo.storage.base.ObjectInfo.version` pinned when the dataset was
    opened), every read is of that version only: a shard replaced or rewritten since raises
    :class:`ShardChangedError` naming it.
    """

    def __init__(
        self, storage: Storage, key: str, index: ChunkIndex | None = None, *, version: str | None = None
    ) -> None:
        self.storage = storage
        self.key = key
        #: The shard's URL, used in messages.
        self.url = storage.describe(key)
        self.version = version
        self._index = index if index is not None else self._load_index()

    @property
    def index(self) -> ChunkIndex:
        """The shard's chunk index."""
        return self._index

    @property
    def num_records(self) -> int:
        """Number of records in the shard."""
        return self._index.num_records

    def read(self, start: int, end: int) -> list[bytes]:
        """Records ``[start, end)``, fetched with exactly one ranged :meth:`Storage.read` of the chunks
        that hold them (none at all when ``start == end``).

        Raises ``ValueError`` unless ``0 <= start <= end <= num_records`` (a caller bug, not bad data).
        """
        span = self._index.chunk_span(start, end)
        if not span:
            return []
        return self._decode(span, self._read_span(span), start, end)

    def iter_records(self) -> Iterator[bytes]:
        """Every record of the shard in order, reading about :data:`SEQUENTIAL_READ_BYTES` at a time."""
        for span in self._sequential_spans():
            yield from self._decode(span, self._read_span(span))

    def verify(self) -> ShardSummary:
        """Read, checksum and decode every chunk, in large sequential reads; summarize the shard.

        Also checks that the shard's size still matches the index. Raises :class:`RecordIOError` at the
        first problem.
        """
        size = self._stat().size
        if size != self._index.file_size:
            raise RecordIOError(
                self.url,
                f"the shard has {size} bytes but its index describes {self._index.file_size} "
                "(it changed after it was indexed)",
            )
        records = 0
        digest = hashlib.sha256()
        for span in self._sequential_spans():  # consecutive spans that tile the file
            data = self._read_span(span)
            digest.update(data)
            records += len(self._decode(span, data))
        compressors = Counter(entry.compressor.label for entry in self._index.entries)
        return ShardSummary(
            key=self.key,
            records=records,
            chunks=len(self._index.entries),
            bytes=self._index.file_size,
            compressors=dict(sorted(compressors.items())),
            sha256=digest.hexdigest(),
        )

    # ----------------------------------------------------------------------------------------- internals

    def _stat(self) -> ObjectInfo:
        info = self.storage.stat(self.key)
        if self.version is not None and info.version != self.version:
            raise ShardChangedError(self.url, self.version, info.version)
        return info

    def _load_index(self) -> ChunkIndex:
        size = self._stat().size
        sidecar_key = self.key + INDEX_SUFFIX
        sidecar_url = self.storage.describe(sidecar_key)
        try:
            data = self.storage.read(sidecar_key)
        except ObjectNotFoundError:
            log.debug("recordio_index_missing", shard=self.url)
        else:
            try:
                index = ChunkIndex.from_bytes(data, file=sidecar_url)
            except RecordIOError as exc:
                log.warning("recordio_index_corrupt", shard=self.url, error=str(exc))
            else:
                if index.file_size == size:
                    return index
                log.warning(
                    "recordio_index_stale", shard=self.url, shard_bytes=size, index_bytes=index.file_size
                )
        return ChunkIndex.scan(self._read_range, size, file=self.url)

    def _read_range(self, offset: int, length: int) -> bytes:
        if self.version is None:
            return self.storage.read(self.key, offset, length)
        try:
            return self.storage.read_version(self.key, offset, length, version=self.version)
        except ObjectChangedError:
            raise ShardChangedError(self.url, self.version, self._current_version()) from None
        except ObjectNotFoundError:
            raise ShardChangedError(self.url, self.version, "") from None

    def _current_version(self) -> str:
        try:
            return self.storage.stat(self.key).version
        except ObjectNotFoundError:
            return ""

    def _read_span(self, span: range) -> bytes:
        return self._read_range(*self._index.span_bytes(span))

    def _sequential_spans(self) -> Iterator[range]:
        """Consecutive runs of chunks of about :data:`SEQUENTIAL_READ_BYTES` each, covering the shard."""
        entries = self._index.entries
        start = 0
        for number, entry in enumerate(entries):
            if number > start and entry.end - entries[start].offset > SEQUENTIAL_READ_BYTES:
                yield range(start, number)
                start = number
        if entries:
            yield range(start, len(entries))

    def _decode(self, span: range, data: bytes, start: int = 0, end: int | None = None) -> list[bytes]:
        """Records ``[start, end)`` of the shard (default: all) found in the chunks ``span``, given
        ``data`` = the bytes read for exactly that span. Every chunk in the span is fully validated."""
        entries = self._index.entries
        base = entries[span.start].offset
        records: list[bytes] = []
        for number in span:
            entry = entries[number]
            chunk_start = entry.offset - base
            chunk_end = min(chunk_start + entry.size, len(data))  # a short read shows as a truncated chunk
            header, chunk_records = decode_chunk_at(
                data,
                chunk_start,
                chunk_end,
                file=self.url,
                chunk=number,
                offset=entry.offset,
                first=start - entry.first_record,
                stop=None if end is None else end - entry.first_record,
            )
            if header.num_records != entry.num_records or header.compressor != entry.compressor:
                raise RecordIOError(
                    self.url,
                    f"the chunk header ({header.num_records} records, {header.compressor.label}) disagrees "
                    f"with the index ({entry.num_records} records, {entry.compressor.label}); the shard "
                    "changed after it was indexed",
                    chunk=number,
                    offset=entry.offset,
                )
            records += chunk_records
        return records
