"""Where each chunk of a RecordIO shard lives, so any record range costs one ranged read.

A :class:`ChunkIndex` is built while writing (:class:`~edl_argo.recordio.writer.RecordIOWriter`), by
hopping from chunk header to chunk header (:meth:`ChunkIndex.scan`), or loaded from the shard's sidecar
object ``<shard>`` + :data:`INDEX_SUFFIX` (:meth:`ChunkIndex.from_bytes`).

Sidecar format, version 1 (all integers little-endian)::

    offset  size    field
    0       8       magic b"EDLRIDX\\0"
    8       4       version (uint32) = 1
    12      4       number of chunks N (uint32)
    16      8       size of the shard in bytes (uint64)
    24      24*N    per chunk: offset (uint64), size = header + payload (uint64),
                    record count (uint32), compressor (uint32)
    24+24N  4       CRC-32 (IEEE) of bytes [0, 24+24N)
"""

from __future__ import annotations

import bisect
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from edl_argo.recordio.chunk import (
    HEADER_SIZE,
    Compressor,
    RecordIOError,
    parse_header,
    payload_size_error,
)

#: A shard ``foo`` has its index sidecar at ``foo.edl-index``.
INDEX_SUFFIX = ".edl-index"

_SIDECAR_MAGIC = b"EDLRIDX\0"
_SIDECAR_VERSION = 1
_SIDECAR_HEAD = struct.Struct("<8sIIQ")
_SIDECAR_ENTRY = struct.Struct("<QQII")
_SIDECAR_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk of a shard: ``size`` bytes (header + stored payload) starting at byte ``offset``,
    holding records ``[first_record, first_record + num_records)`` of the shard."""

    offset: int
    size: int
    num_records: int
    first_record: int
    compressor: Compressor

    @property
    def end(self) -> int:
        """Byte offset just past the chunk."""
        return self.offset + self.size


class ChunkIndex:
    """The chunks of one shard, in file order; they tile the file exactly from byte 0 to ``file_size``."""

    __slots__ = ("_firsts", "entries", "file_size", "num_records")

    def __init__(self, entries: Iterable[ChunkEntry], file_size: int) -> None:
        """Raises ``ValueError`` unless the entries are contiguous from byte 0, end exactly at
        ``file_size``, are at least a header long, and number their records consecutively from 0."""
        self.entries: tuple[ChunkEntry, ...] = tuple(entries)
        self.file_size = file_size
        offset = records = 0
        for number, entry in enumerate(self.entries):
            if entry.offset != offset or entry.first_record != records:
                raise ValueError(
                    f"chunk {number} starts at byte {entry.offset}, record {entry.first_record}; "
                    f"expected byte {offset}, record {records}"
                )
            if entry.size < HEADER_SIZE or entry.num_records < 0:
                raise ValueError(f"chunk {number} at byte {offset} has impossible size {entry.size}")
            offset += entry.size
            records += entry.num_records
        if offset != file_size:
            raise ValueError(f"chunks cover {offset} bytes but the file has {file_size}")
        #: Total number of records in the shard.
        self.num_records: int = records
        self._firsts = [entry.first_record for entry in self.entries]

    @classmethod
    def from_layout(cls, chunks: Iterable[tuple[int, int, int, Compressor]], file_size: int) -> ChunkIndex:
        """Build an index from ``(offset, size, num_records, compressor)`` per chunk, in file order.

        Record numbers are assigned consecutively; the layout is validated as in :meth:`__init__`.
        """
        entries = []
        first = 0
        for offset, size, num_records, compressor in chunks:
            entries.append(ChunkEntry(offset, size, num_records, first, Compressor(compressor)))
            first += num_records
        return cls(entries, file_size)

    # ------------------------------------------------------------------------------------ random access

    def chunk_span(self, start: int, end: int) -> range:
        """Numbers of the chunks holding records ``[start, end)``: the smallest contiguous run.

        Empty when ``start == end``. Raises ``ValueError`` unless ``0 <= start <= end <= num_records``.
        """
        if not 0 <= start <= end <= self.num_records:
            raise ValueError(
                f"record range [{start}, {end}) is outside the shard's {self.num_records} records "
                f"(need 0 <= start <= end <= {self.num_records})"
            )
        if start == end:
            return range(0)
        # bisect_right skips chunks holding no records that share a first_record with the next chunk.
        first = bisect.bisect_right(self._firsts, start) - 1
        last = bisect.bisect_right(self._firsts, end - 1) - 1
        return range(first, last + 1)

    def span_bytes(self, span: range) -> tuple[int, int]:
        """``(offset, length)`` of the bytes the consecutive chunks ``span`` occupy; ``(0, 0)`` if empty."""
        if not span:
            return 0, 0
        offset = self.entries[span.start].offset
        return offset, self.entries[span.stop - 1].end - offset

    def byte_range(self, start: int, end: int) -> tuple[int, int, list[ChunkEntry]]:
        """``(offset, length, chunks)``: the one byte range to read for records ``[start, end)``.

        It covers exactly the chunks holding those records (and nothing else); ``(0, 0, [])`` when
        ``start == end``. Raises ``ValueError`` for a range outside ``[0, num_records]``.
        """
        span = self.chunk_span(start, end)
        offset, length = self.span_bytes(span)
        return offset, length, list(self.entries[span.start : span.stop])

    # ---------------------------------------------------------------------------------------- building

    @classmethod
    def scan(cls, read: Callable[[int, int], bytes], file_size: int, *, file: str) -> ChunkIndex:
        """Index a shard by reading only its chunk headers, hopping from one to the next.

        ``read(offset, length)`` returns bytes ``[offset, offset + length)`` of the shard (one small
        ranged read per chunk; payloads are never read). Each header's magic and compressor are checked,
        and its payload must fit in ``file_size``; otherwise :class:`RecordIOError` names ``file``, the
        chunk and its offset.
        """
        layout: list[tuple[int, int, int, Compressor]] = []
        offset = 0
        while offset < file_size:
            head = read(offset, HEADER_SIZE)[: file_size - offset]
            header = parse_header(head, file=file, chunk=len(layout), offset=offset)
            if offset + header.chunk_size > file_size:
                available = file_size - offset - HEADER_SIZE
                raise payload_size_error(header, available, file=file, chunk=len(layout), offset=offset)
            layout.append((offset, header.chunk_size, header.num_records, header.compressor))
            offset += header.chunk_size
        return cls.from_layout(layout, file_size)

    # ----------------------------------------------------------------------------------------- sidecar

    def to_bytes(self) -> bytes:
        """Serialize as a version-1 sidecar (see the module docstring for the layout)."""
        parts = [_SIDECAR_HEAD.pack(_SIDECAR_MAGIC, _SIDECAR_VERSION, len(self.entries), self.file_size)]
        parts += [_SIDECAR_ENTRY.pack(e.offset, e.size, e.num_records, e.compressor) for e in self.entries]
        body = b"".join(parts)
        return body + _SIDECAR_CRC.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes, *, file: str) -> ChunkIndex:
        """Parse a sidecar written by :meth:`to_bytes`.

        Raises :class:`RecordIOError` naming the sidecar ``file`` if the magic, version, length or
        checksum is wrong, or if the chunks it lists do not tile the file it describes.
        """

        def bad(detail: str) -> RecordIOError:
            return RecordIOError(file, detail, kind="index")

        head_size, entry_size, crc_size = _SIDECAR_HEAD.size, _SIDECAR_ENTRY.size, _SIDECAR_CRC.size
        if len(data) < head_size + crc_size:
            raise bad(f"truncated: {len(data)} bytes, a sidecar has at least {head_size + crc_size}")
        magic, version, num_chunks, file_size = _SIDECAR_HEAD.unpack_from(data, 0)
        if magic != _SIDECAR_MAGIC:
            raise bad(f"bad magic {magic!r} (expected {_SIDECAR_MAGIC!r}); not an edl-argo index?")
        if version != _SIDECAR_VERSION:
            raise bad(f"unsupported version {version} (this edl-argo reads version {_SIDECAR_VERSION})")
        expected_size = head_size + num_chunks * entry_size + crc_size
        if len(data) != expected_size:
            raise bad(f"{len(data)} bytes, but {num_chunks} chunks need {expected_size}")
        (stored_crc,) = _SIDECAR_CRC.unpack_from(data, expected_size - crc_size)
        computed = zlib.crc32(memoryview(data)[: expected_size - crc_size])
        if stored_crc != computed:
            raise bad(f"checksum mismatch (stored 0x{stored_crc:08x}, computed 0x{computed:08x})")
        layout = list(_SIDECAR_ENTRY.iter_unpack(memoryview(data)[head_size : expected_size - crc_size]))
        try:
            return cls.from_layout(layout, file_size)
        except ValueError as exc:  # an unknown compressor code, or chunks that do not tile the file
            raise bad(f"inconsistent chunk list: {exc}") from None

    # ------------------------------------------------------------------------------------------- misc

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChunkIndex):
            return NotImplemented
        return self.file_size == other.file_size and self.entries == other.entries

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"ChunkIndex(chunks={len(self.entries)}, records={self.num_records}, file_size={self.file_size})"
        )
