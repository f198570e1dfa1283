"""TFRecord files (``.tfrecord``, ``.tfrecords``, and the same GZIP-compressed with ``.gz``).

A TFRecord file is a sequence of records, each framed as::

    uint64 length | uint32 masked CRC-32C of length | length bytes of data | uint32 masked CRC-32C of data

(little-endian; the mask is TensorFlow's, :func:`masked_crc`). Every file is a shard.

**Uncompressed files** are indexed once when the dataset is opened: a scan in blocks of
:data:`SCAN_BLOCK_BYTES` records the byte offset of every :data:`~edl_argo.readers.files.INDEX_STRIDE`-th
record (:class:`~edl_argo.readers.files.OffsetIndex`), checking each length's checksum, and the file must
end exactly after its last record. A task's hint is the byte range holding its records, so a worker reads
them with one ranged read and checks every data checksum.

**GZIP files** cannot be entered in the middle: opening decompresses each file once, streaming, to count
its records, and a worker decompresses from the file's start and skips to its range. So a task late in a
large ``.gz`` file costs a read of the file up to its range: split such data into many smaller files, or
store it uncompressed, to read it at the speed of uncompressed files.

Records are serialized ``tf.train.Example`` protos as the model's ``feed`` parses them; the reader does not
look inside them.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import google_crc32c

from edl_argo.errors import DataFormatError
from edl_argo.readers.base import (
    DataFormat,
    OpenedDataset,
    RangeReader,
    ReaderSpec,
    Records,
    ShardInfo,
    serialized_records,
)
from edl_argo.readers.files import INDEX_STRIDE, OffsetIndex, PinnedFiles, RangeHint, list_data_files

SUFFIXES = (".tfrecord", ".tfrecords", ".tfrecord.gz", ".tfrecords.gz")
#: Bytes read per storage call when a file is scanned or streamed.
SCAN_BLOCK_BYTES = 8 << 20
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8


def masked_crc(data: bytes | bytearray | memoryview) -> int:
    """TensorFlow's masked CRC-32C of ``data``, as TFRecord frames store it."""
    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(record: bytes) -> bytes:
    """``record`` framed as one TFRecord (what ``tf.io.TFRecordWriter`` writes for it)."""
    length = struct.pack("<Q", len(record))
    return length + struct.pack("<I", masked_crc(length)) + record + _FOOTER.pack(masked_crc(record))


def is_gzip(key: str) -> bool:
    return key.endswith(".gz")


def parse_frames(
    blocks: Iterable[bytes], *, base: int = 0, check_data: bool = True, where: Callable[[int], str]
) -> Iterator[tuple[int, bytes]]:
    """``(offset, data)`` of each record in the concatenation of ``blocks``, whose first byte is at file
    offset ``base``. DataFormatError with ``where(offset)`` (naming the file and the record's offset) for
    a checksum that does not match or a record cut short by the end of the input."""
    buffer = bytearray()
    position = 0  # of the next frame in buffer
    for block in blocks:
        if position:
            del buffer[:position]
            base += position
            position = 0
        buffer += block
        while len(buffer) - position >= _HEADER.size:
            length, length_crc = _HEADER.unpack_from(buffer, position)
            if masked_crc(buffer[position : position + 8]) != length_crc:
                raise DataFormatError(f"{where(base + position)}: the record's length fails its checksum")
            end = position + _HEADER.size + length + _FOOTER.size
            if end > len(buffer):
                break
            data = bytes(buffer[position + _HEADER.size : end - _FOOTER.size])
            if check_data and masked_crc(data) != _FOOTER.unpack_from(buffer, end - _FOOTER.size)[0]:
                raise DataFormatError(f"{where(base + position)}: the record's data fails its checksum")
            yield base + position, data
            position = end
    if len(buffer) > position:
        raise DataFormatError(f"{where(base + position)}: the file ends inside a record")


def _blocks(files: PinnedFiles, key: str, version: str, start: int, end: int) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of ``key`` in blocks of :data:`SCAN_BLOCK_BYTES` (``end`` -1: to the end)."""
    if end < 0:
        end = files.size(key, version)
    offset = start
    while offset < end:
        length = min(SCAN_BLOCK_BYTES, end - offset)
        block = files.read(key, offset, length, version)
        if not block:
            return
        yield block
        offset += len(block)


def _decompressed(blocks: Iterable[bytes], name: str) -> Iterator[bytes]:
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        for block in blocks:
            while block:
                yield decompressor.decompress(block, SCAN_BLOCK_BYTES)
                block = decompressor.unconsumed_tail
        yield decompressor.flush()
    except zlib.error as error:
        raise DataFormatError(f"TFRecord file {name}: not readable as GZIP ({error})") from None
    if not decompressor.eof:
        raise DataFormatError(f"TFRecord file {name}: the GZIP stream ends early (a truncated file)")


class TFRecordReader(RangeReader):
    """Reads record ranges of a dataset's TFRecord files (see the module docstring)."""

    def __init__(self, spec: ReaderSpec) -> None:
        super().__init__(spec)
        self._files = PinnedFiles(spec.url)

    def frames(self, shard: str, version: str, start: int = 0, end: int = -1) -> Iterator[tuple[int, bytes]]:
        """``(offset, data)`` of the records of bytes ``[start, end)`` of ``shard`` (of its decompressed
        bytes, for a GZIP file, which is always read from its start)."""
        name = self._files.describe(shard)
        blocks = _blocks(self._files, shard, version, 0 if is_gzip(shard) else start, end)
        if is_gzip(shard):
            blocks = _decompressed(blocks, name)
        return parse_frames(
            blocks,
            base=0 if is_gzip(shard) else start,
            where=lambda offset: f"TFRecord file {name}, record at byte {offset}",
        )

    def read(self, shard: str, start: int, end: int, *, version: str = "", hint: str = "") -> Records:
        located = RangeHint.from_str(hint) if hint and not is_gzip(shard) else RangeHint(0, -1, start)
        wanted = end - start
        records: list[bytes] = []
        frames = self.frames(shard, version, located.offset, located.end_offset)
        for number, (_, data) in enumerate(frames):
            if number >= located.skip:
                records.append(data)
                if len(records) == wanted:
                    break
        if len(records) != wanted:
            raise DataFormatError(
                f"TFRecord file {self._files.describe(shard)}: records {start}-{end - 1} asked for, only "
                f"{len(records)} of them found (the file changed since the job indexed it)"
            )
        return serialized_records(records)


class OpenedTFRecord(OpenedDataset):
    def __init__(
        self,
        spec: ReaderSpec,
        shards: Sequence[ShardInfo],
        indexes: dict[str, OffsetIndex],
        reader: TFRecordReader,
    ) -> None:
        super().__init__(spec, shards, reader)
        self._indexes = indexes

    def locate(self, shard: str, start: int, end: int) -> str:
        index = self._indexes.get(shard)
        return index.locate(start, end).to_str() if index is not None else ""


class TFRecordFormat(DataFormat):
    name = "tfrecord"

    def open(self, url: str, options: dict[str, Any], what: str = "") -> OpenedDataset:
        listed = list_data_files(url, lambda key: key.endswith(SUFFIXES), what, self.name)
        spec = ReaderSpec(self.name, listed.folder_url)
        reader = TFRecordReader(spec)
        shards, indexes = [], {}
        for info in listed.files:
            index = _index(reader.frames(info.key, info.version), info.size)
            if not is_gzip(info.key):
                indexes[info.key] = index
            shards.append(ShardInfo(info.key, index.records, info.version))
        return OpenedTFRecord(spec, shards, indexes, reader)  # the reader that indexed them

    def range_reader(self, spec: ReaderSpec) -> RangeReader:
        return TFRecordReader(spec)

    def detect(self, url: str, names: Sequence[str]) -> bool:
        return any(name.endswith(SUFFIXES) for name in names)


def _index(frames: Iterable[tuple[int, bytes]], size: int) -> OffsetIndex:
    offsets = []
    records = 0
    for offset, _ in frames:
        if records % INDEX_STRIDE == 0:
            offsets.append(offset)
        records += 1
    return OffsetIndex(offsets, records, size)
