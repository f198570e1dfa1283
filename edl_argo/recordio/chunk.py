"""One RecordIO chunk: encoding, header parsing and validated decoding.

The layout is byte-compatible with the reference Go library (``github.com/wangkuiyi/recordio``)::

    header  (20 bytes, five little-endian uint32)
        magic        0x01020304
        checksum     CRC-32 (IEEE, as zlib.crc32) of the payload *as stored* (after compression)
        compressor   0 none, 1 snappy (framing format), 2 gzip
        size         number of stored payload bytes that follow the header
        num_records  number of records in the chunk
    payload (``size`` bytes)
        compress(len(r0) as uint32 LE + r0 + len(r1) as uint32 LE + r1 + ...)

Every malformed input is reported as :class:`RecordIOError`; no other exception escapes the decoder.
"""

from __future__ import annotations

import enum
import gzip
import struct
import zlib
from collections.abc import Sequence
from typing import NamedTuple

import cramjam

from edl_argo.errors import DataFormatError

#: First field of every chunk header.
MAGIC = 0x01020304
#: Size of a chunk header in bytes.
HEADER_SIZE = 20
#: Largest value a uint32 header field (record length, payload size, record count) can hold.
MAX_UINT32 = 0xFFFFFFFF

_HEADER = struct.Struct("<5I")
_U32 = struct.Struct("<I")
_GZIP_LEVEL = 6  # Go's gzip.DefaultCompression


class Compressor(enum.IntEnum):
    """How a chunk's payload is compressed (header field 3)."""

    NONE = 0
    SNAPPY = 1  # snappy *framing* format, as written by Go's snappy.NewWriter / NewBufferedWriter
    GZIP = 2

    @property
    def label(self) -> str:
        """Lower-case name used in summaries and messages (``"snappy"``)."""
        return self.name.lower()


class RecordIOError(DataFormatError):
    """A RecordIO shard or index sidecar is malformed.

    ``file`` is the URL of the offending object; ``chunk`` (0-based chunk number) and ``offset`` (byte
    offset of that chunk's header in the file) locate the damage, or are ``None`` when the problem is not
    tied to one chunk (a corrupt sidecar). ``detail`` is the bare description of what is wrong.
    """

    def __init__(
        self,
        file: str,
        detail: str,
        *,
        chunk: int | None = None,
        offset: int | None = None,
        kind: str = "shard",
    ) -> None:
        where = f"corrupt RecordIO {kind} {file}"
        if chunk is not None:
            where += f": chunk {chunk}"
        if offset is not None:
            where += f" at byte {offset}" if chunk is not None else f": at byte {offset}"
        super().__init__(f"{where}: {detail}")
        self.file = file
        self.chunk = chunk
        self.offset = offset
        self.detail = detail


class ChunkHeader(NamedTuple):
    """The decoded fields of a chunk header (the magic number is implied)."""

    checksum: int
    compressor: Compressor
    payload_size: int
    num_records: int

    @property
    def chunk_size(self) -> int:
        """Bytes the whole chunk (header + stored payload) occupies in the file."""
        return HEADER_SIZE + self.payload_size


# ----------------------------------------------------------------------------------------------- encoding


def encode_chunk(records: Sequence[bytes], compressor: Compressor) -> bytes:
    """Encode ``records`` as one complete chunk (header + stored payload).

    Raises ``ValueError`` if a record or the stored payload does not fit the format's uint32 fields and
    ``TypeError`` if a record is not bytes-like.
    """
    compressor = Compressor(compressor)
    parts: list[bytes] = []
    for record in records:
        record = as_record(record)
        parts.append(_U32.pack(len(record)))
        parts.append(record)
    stored = _compress(b"".join(parts), compressor)
    if len(stored) > MAX_UINT32 or len(records) > MAX_UINT32:
        raise ValueError("a RecordIO chunk payload must stay below 4 GiB and 2**32 records")
    header = _HEADER.pack(MAGIC, zlib.crc32(stored), compressor, len(stored), len(records))
    return header + stored


def as_record(record: bytes | bytearray | memoryview) -> bytes:
    """``record`` as immutable bytes (no copy for ``bytes``); ``TypeError`` unless bytes-like,
    ``ValueError`` if longer than a uint32 length prefix allows."""
    if not isinstance(record, (bytes, bytearray, memoryview)):
        raise TypeError(f"RecordIO records must be bytes, not {type(record).__name__}")
    record = bytes(record)
    if len(record) > MAX_UINT32:
        raise ValueError(f"a RecordIO record can hold at most {MAX_UINT32} bytes, got {len(record)}")
    return record


def _compress(raw: bytes, compressor: Compressor) -> bytes:
    if compressor is Compressor.NONE:
        return raw
    if compressor is Compressor.SNAPPY:
        return bytes(cramjam.snappy.compress(raw))
    return gzip.compress(raw, compresslevel=_GZIP_LEVEL, mtime=0)


# ----------------------------------------------------------------------------------------------- decoding


def parse_header(data: bytes | bytearray | memoryview, *, file: str, chunk: int, offset: int) -> ChunkHeader:
    """Parse and validate the chunk header at the start of ``data``.

    ``file``, ``chunk`` and ``offset`` only label errors. Raises :class:`RecordIOError` if fewer than
    :data:`HEADER_SIZE` bytes are given, the magic number is wrong or the compressor is unknown. The
    payload size is *not* checked against anything here; callers compare it with what they have.
    """
    return _parse_header_at(data, 0, len(data), file, chunk, offset)


def decode_chunk(data: bytes | bytearray | memoryview, *, file: str, chunk: int, offset: int) -> list[bytes]:
    """Decode one complete chunk: ``data`` must be exactly its header followed by its stored payload.

    Validates the magic number, compressor, payload length, CRC-32 of the stored payload, the
    decompression, and that the decompressed payload holds exactly the declared number of records.
    Raises :class:`RecordIOError` (labelled with ``file``, ``chunk`` and ``offset``) on any problem.
    """
    return decode_chunk_at(data, 0, len(data), file=file, chunk=chunk, offset=offset)[1]


def decode_chunk_at(
    buf: bytes | bytearray | memoryview,
    start: int,
    end: int,
    *,
    file: str,
    chunk: int,
    offset: int,
    first: int = 0,
    stop: int | None = None,
) -> tuple[ChunkHeader, list[bytes]]:
    """Decode the chunk occupying exactly ``buf[start:end]``; return its header and records.

    This is :func:`decode_chunk` without copying the chunk out of a larger buffer (a ranged read that
    covers several chunks). Only records ``[first, stop)`` of the chunk are returned (``stop=None``: to
    the end; the range is clipped to the chunk), but the whole chunk is validated either way.
    """
    header = _parse_header_at(buf, start, end, file, chunk, offset)
    payload_start = start + HEADER_SIZE
    available = end - payload_start
    if header.payload_size != available:
        raise payload_size_error(header, available, file=file, chunk=chunk, offset=offset)
    stored = memoryview(buf)[payload_start:end]
    computed = zlib.crc32(stored)
    if computed != header.checksum:
        raise RecordIOError(
            file,
            f"checksum mismatch (stored 0x{header.checksum:08x}, computed 0x{computed:08x})",
            chunk=chunk,
            offset=offset,
        )
    count = header.num_records
    stop = count if stop is None else max(min(stop, count), 0)
    first = max(min(first, stop), 0)
    raw: bytes | bytearray | memoryview
    if header.compressor is Compressor.NONE:
        pos, raw = payload_start, buf  # records are sliced straight out of the read buffer
    else:
        pos, raw = 0, _decompress(stored, header.compressor, file, chunk, offset)
        end = len(raw)
    size = end - pos
    if count * 4 > size:
        raise RecordIOError(
            file,
            f"header declares {count} records but the {size}-byte decompressed payload holds at most "
            f"{size // 4}",
            chunk=chunk,
            offset=offset,
        )
    pos, done = _skip_records(raw, pos, end, first)
    records: list[bytes] = []
    if done == first:
        pos, records = _take_records(raw, pos, end, stop - first)
        done += len(records)
        if done == stop:
            pos, skipped = _skip_records(raw, pos, end, count - stop)
            done += skipped
    if done != count:
        raise RecordIOError(
            file,
            f"the {size}-byte decompressed payload ends inside record {done} of the {count} declared "
            "(wrong record count or lengths)",
            chunk=chunk,
            offset=offset,
        )
    if pos != end:
        raise RecordIOError(
            file,
            f"{end - pos} bytes left over after the {count} declared records (wrong record count)",
            chunk=chunk,
            offset=offset,
        )
    if not isinstance(raw, bytes):  # slices of a memoryview or bytearray: copy them out as bytes
        records = [bytes(record) for record in records]
    return header, records


def _parse_header_at(
    buf: bytes | bytearray | memoryview, start: int, end: int, file: str, chunk: int, offset: int
) -> ChunkHeader:
    if end - start < HEADER_SIZE:
        raise RecordIOError(
            file,
            f"truncated header: {max(end - start, 0)} of {HEADER_SIZE} bytes present",
            chunk=chunk,
            offset=offset,
        )
    magic, checksum, compressor, payload_size, num_records = _HEADER.unpack_from(buf, start)
    if magic != MAGIC:
        raise RecordIOError(
            file,
            f"bad magic number 0x{magic:08x} (expected 0x{MAGIC:08x}); not a RecordIO file?",
            chunk=chunk,
            offset=offset,
        )
    try:
        kind = Compressor(compressor)
    except ValueError:
        raise RecordIOError(
            file,
            f"unknown compressor {compressor} (known: 0 none, 1 snappy, 2 gzip)",
            chunk=chunk,
            offset=offset,
        ) from None
    return ChunkHeader(checksum, kind, payload_size, num_records)


def payload_size_error(
    header: ChunkHeader, available: int, *, file: str, chunk: int, offset: int
) -> RecordIOError:
    """The error for a chunk whose header declares a payload size other than the ``available`` bytes."""
    if header.payload_size > available:
        detail = f"truncated: header declares a {header.payload_size}-byte payload, only {available} present"
    else:
        detail = (
            f"header declares a {header.payload_size}-byte payload but the chunk spans {available} bytes "
            "(the shard changed after it was indexed?)"
        )
    return RecordIOError(file, detail, chunk=chunk, offset=offset)


def _decompress(
    stored: memoryview, compressor: Compressor, file: str, chunk: int, offset: int
) -> bytes | memoryview:
    # cramjam's buffer is used in place, not copied into bytes: one more large allocation per chunk
    # measurably slows reads down.
    try:
        if compressor is Compressor.SNAPPY:
            return memoryview(cramjam.snappy.decompress(stored))
        return gzip.decompress(stored)
    except Exception as exc:  # cramjam.DecompressionError, zlib.error, EOFError, BadGzipFile, ...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise RecordIOError(
            file, f"{compressor.label} payload does not decompress: {reason}", chunk=chunk, offset=offset
        ) from None


# The two loops below are the hot path of every read: per record one ``unpack_from``, one bounds check and
# (when taken) one slice. A length prefix past the end of ``buf`` raises struct.error; one straddling
# ``end`` makes the record overrun ``end``: both stop the walk, and the caller reports the short count.


def _skip_records(buf: bytes | bytearray | memoryview, pos: int, end: int, n: int) -> tuple[int, int]:
    """Walk over up to ``n`` length-prefixed records in ``buf[pos:end]``; return (new pos, records walked)."""
    unpack = _U32.unpack_from
    for i in range(n):
        try:
            (length,) = unpack(buf, pos)
        except struct.error:
            return pos, i
        following = pos + 4 + length
        if following > end:
            return pos, i
        pos = following
    return pos, n


def _take_records(buf: bytes | bytearray | memoryview, pos: int, end: int, n: int) -> tuple[int, list[bytes]]:
    """Like :func:`_skip_records`, but return the records walked (slices of ``buf``), not their number."""
    unpack = _U32.unpack_from
    records: list[bytes] = []
    append = records.append
    for _ in range(n):
        try:
            (length,) = unpack(buf, pos)
        except struct.error:
            break
        start = pos + 4
        following = start + length
        if following > end:
            break
        append(buf[start:following])
        pos = following
    return pos, records
