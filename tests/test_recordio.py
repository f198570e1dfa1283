"""RecordIO: round trips, random access with one ranged read, corruption handling, the index sidecar,
fuzzing, and compatibility with an independently written reference-layout file."""

from __future__ import annotations

import contextlib
import gzip
import io
import random
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import cramjam
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edl_argo.errors import DataFormatError
from edl_argo.recordio import (
    HEADER_SIZE,
    INDEX_SUFFIX,
    MAGIC,
    ChunkIndex,
    Compressor,
    RecordIOError,
    RecordIOWriter,
    ShardReader,
    decode_chunk,
    encode_chunk,
    list_shards,
    parse_header,
    write_shard,
)
from edl_argo.recordio import reader as reader_module
from edl_argo.storage.base import ObjectInfo, ObjectNotFoundError, Storage

KEY = "train/shard-0003"
URL = f"mem://bucket/{KEY}"


class MemStorage(Storage):
    """A dict of bytes that records every successful ``read`` as ``(key, offset, length)``."""

    def __init__(self) -> None:
        self.url = "mem://bucket"
        self.objects: dict[str, bytes] = {}
        self.reads: list[tuple[str, int, int | None]] = []

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return [ObjectInfo(k, len(v)) for k, v in sorted(self.objects.items()) if k.startswith(prefix)]

    def stat(self, key: str) -> ObjectInfo:
        if key not in self.objects:
            raise ObjectNotFoundError(f"no object {self.describe(key)}")
        return ObjectInfo(key, len(self.objects[key]))

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if key not in self.objects:
            raise ObjectNotFoundError(f"no object {self.describe(key)}")
        self.reads.append((key, offset, length))
        data = self.objects[key]
        return data[offset : None if length is None else offset + length]

    def write(self, key: str, data: bytes) -> None:
        self.objects[key] = bytes(data)

    def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    def put_tree(self, local_dir: Path, key: str) -> None:
        raise NotImplementedError

    def get_tree(self, key: str, local_dir: Path) -> None:
        raise NotImplementedError

    def shard_reads(self) -> list[tuple[int, int | None]]:
        """``(offset, length)`` of the reads of the shard (not of its sidecar)."""
        return [(offset, length) for key, offset, length in self.reads if key == KEY]


def sample_records(n: int, seed: int = 0) -> list[bytes]:
    """Varied records: empty, tiny, compressible and random ones."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(b"")
        elif kind == 1:
            out.append(rnd.randbytes(rnd.randrange(1, 40)))
        elif kind == 2:
            out.append(b"feature-%d," % i * rnd.randrange(1, 30))
        else:
            out.append(rnd.randbytes(rnd.randrange(100, 700)))
    return out


def uniform_shard(
    compressor: Compressor = Compressor.NONE, chunks: int = 5, per_chunk: int = 10
) -> tuple[MemStorage, list[bytes]]:
    """A shard of ``chunks`` chunks of exactly ``per_chunk`` 96-byte records (100 payload bytes each)."""
    storage = MemStorage()
    records = [bytes([i % 256]) * 96 for i in range(chunks * per_chunk)]
    write_shard(storage, KEY, records, compressor, max_chunk_bytes=100 * per_chunk)
    storage.reads.clear()
    return storage, records


def set_u32(data: bytearray, pos: int, value: int) -> None:
    struct.pack_into("<I", data, pos, value)


def fix_crc(data: bytearray, offset: int, end: int) -> None:
    """Recompute the checksum of the chunk at ``data[offset:end]`` after tampering with its payload."""
    set_u32(data, offset + 4, zlib.crc32(data[offset + HEADER_SIZE : end]))


def assert_located(exc: RecordIOError, chunk: int, offset: int) -> None:
    assert (exc.file, exc.chunk, exc.offset) == (URL, chunk, offset)
    assert str(exc).startswith(f"corrupt RecordIO shard {URL}: chunk {chunk} at byte {offset}: ")
    assert "\n" not in str(exc)


# -- round trips -------------------------------------------------------------------------------------


@pytest.mark.parametrize("compressor", list(Compressor))
def test_round_trip(compressor: Compressor) -> None:
    storage = MemStorage()
    records = sample_records(300)
    index = write_shard(storage, KEY, records, compressor, max_chunk_bytes=4096)
    assert len(index.entries) > 5
    assert index.num_records == 300 and index.file_size == len(storage.objects[KEY])
    assert {e.compressor for e in index.entries} == {compressor}

    shard = ShardReader(storage, KEY)
    assert shard.index == index
    assert shard.num_records == 300
    assert shard.read(0, 300) == records
    assert list(shard.iter_records()) == records
    summary = shard.verify()
    assert (summary.key, summary.records, summary.chunks) == (KEY, 300, len(index.entries))
    assert summary.bytes == index.file_size
    assert summary.compressors == {compressor.label: len(index.entries)}


def test_empty_records_round_trip() -> None:
    storage = MemStorage()
    write_shard(storage, KEY, [b""] * 7, Compressor.SNAPPY)
    assert ShardReader(storage, KEY).read(0, 7) == [b""] * 7


def test_zero_record_shard() -> None:
    storage = MemStorage()
    index = write_shard(storage, KEY, [])
    assert storage.objects[KEY] == b"" and index.entries == () and index.num_records == 0
    assert ChunkIndex.scan(lambda o, n: b"", 0, file=URL) == index
    shard = ShardReader(storage, KEY)
    storage.reads.clear()
    assert shard.read(0, 0) == [] and list(shard.iter_records()) == []
    assert storage.reads == []
    assert shard.verify().records == 0


def test_record_bigger_than_max_chunk_bytes_gets_its_own_chunk() -> None:
    storage = MemStorage()
    records = [b"a" * 10, b"b" * 500, b"c" * 10, b"d" * 10]
    index = write_shard(storage, KEY, records, Compressor.GZIP, max_chunk_bytes=100)
    assert [e.num_records for e in index.entries] == [1, 1, 2]
    assert ShardReader(storage, KEY).read(0, 4) == records


def test_chunks_are_cut_at_max_chunk_bytes_of_uncompressed_payload() -> None:
    _, records = uniform_shard(Compressor.SNAPPY, chunks=3, per_chunk=10)
    buffer = io.BytesIO()
    with RecordIOWriter(buffer, Compressor.SNAPPY, max_chunk_bytes=1000) as writer:
        for record in records:
            writer.write(record)
    assert writer.index is not None and writer.num_records == 30
    assert [e.num_records for e in writer.index.entries] == [10, 10, 10]
    assert writer.close() is writer.index  # idempotent
    assert writer.index.file_size == len(buffer.getvalue())


def test_writer_contract() -> None:
    buffer = io.BytesIO()
    writer = RecordIOWriter(buffer, Compressor.NONE)
    writer.write(bytearray(b"xy"))
    writer.write(memoryview(b"z"))
    with pytest.raises(TypeError, match="bytes"):
        writer.write("text")  # type: ignore[arg-type]
    writer.close()
    assert decode_chunk(buffer.getvalue(), file="f", chunk=0, offset=0) == [b"xy", b"z"]
    with pytest.raises(ValueError, match="closed"):
        writer.write(b"more")
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        RecordIOWriter(io.BytesIO(), max_chunk_bytes=0)

    failed = io.BytesIO()
    with pytest.raises(RuntimeError), RecordIOWriter(failed) as writer:
        writer.write(b"half")
        raise RuntimeError("producer failed")
    assert failed.getvalue() == b"" and writer.index is None  # a failure does not complete the shard


def test_write_shard_writes_the_shard_before_its_sidecar() -> None:
    class Recording(MemStorage):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def write(self, key: str, data: bytes) -> None:
            self.calls.append(f"write {key}")
            super().write(key, data)

        def delete(self, key: str) -> None:
            self.calls.append(f"delete {key}")
            super().delete(key)

    storage = Recording()
    write_shard(storage, KEY, [b"r"])
    sidecar = KEY + INDEX_SUFFIX
    assert storage.calls == [f"delete {sidecar}", f"write {KEY}", f"write {sidecar}"]


# -- random access -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "end", "chunks"),
    [
        (0, 10, [0]),  # exactly one chunk
        (10, 20, [1]),  # starts and ends on chunk boundaries
        (9, 11, [0, 1]),  # straddles a boundary
        (10, 11, [1]),  # first record of a chunk
        (19, 20, [1]),  # last record of a chunk
        (23, 24, [2]),  # single record
        (5, 45, [0, 1, 2, 3, 4]),
        (0, 50, [0, 1, 2, 3, 4]),  # whole file
        (49, 50, [4]),
    ],
)
@pytest.mark.parametrize("compressor", [Compressor.NONE, Compressor.SNAPPY])
def test_read_uses_one_ranged_read_of_exactly_the_needed_chunks(
    compressor: Compressor, start: int, end: int, chunks: list[int]
) -> None:
    storage, records = uniform_shard(compressor)
    shard = ShardReader(storage, KEY)
    storage.reads.clear()
    assert shard.read(start, end) == records[start:end]
    entries = shard.index.entries
    needed = (entries[chunks[0]].offset, entries[chunks[-1]].end - entries[chunks[0]].offset)
    assert storage.shard_reads() == [needed]
    assert shard.index.byte_range(start, end) == (*needed, [entries[i] for i in chunks])


def test_empty_range_reads_nothing() -> None:
    storage, _ = uniform_shard()
    shard = ShardReader(storage, KEY)
    storage.reads.clear()
    assert shard.read(20, 20) == [] and storage.reads == []
    assert shard.index.byte_range(20, 20) == (0, 0, [])


@pytest.mark.parametrize(("start", "end"), [(-1, 3), (0, 51), (5, 4), (51, 51)])
def test_bad_ranges_are_value_errors(start: int, end: int) -> None:
    storage, _ = uniform_shard()
    shard = ShardReader(storage, KEY)
    with pytest.raises(ValueError, match="outside the shard's 50 records"):
        shard.read(start, end)
    with pytest.raises(ValueError):
        shard.index.byte_range(start, end)


def test_sequential_reads_come_in_large_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    storage, records = uniform_shard(Compressor.NONE, chunks=6)
    shard = ShardReader(storage, KEY)
    storage.reads.clear()
    assert shard.verify().records == 60 and len(storage.shard_reads()) == 1

    chunk_size = shard.index.entries[0].size
    monkeypatch.setattr(reader_module, "SEQUENTIAL_READ_BYTES", 2 * chunk_size)
    storage.reads.clear()
    assert list(shard.iter_records()) == records
    assert [length for _, length in storage.shard_reads()] == [2 * chunk_size] * 3


# -- corruption ----------------------------------------------------------------------------------------


def three_chunk_shard(compressor: Compressor = Compressor.NONE) -> tuple[MemStorage, bytearray, ChunkIndex]:
    storage, _ = uniform_shard(compressor, chunks=3)
    index = ChunkIndex.from_bytes(storage.objects[KEY + INDEX_SUFFIX], file="sidecar")
    return storage, bytearray(storage.objects[KEY]), index


def test_checksum_mismatch_names_shard_chunk_and_offset() -> None:
    storage, data, index = three_chunk_shard(Compressor.SNAPPY)
    bad = index.entries[1]
    data[bad.offset + HEADER_SIZE + 7] ^= 0x40
    storage.objects[KEY] = bytes(data)
    shard = ShardReader(storage, KEY)  # the sidecar still matches the size
    assert shard.read(0, 10) == [bytes([i]) * 96 for i in range(10)]  # other chunks stay readable
    with pytest.raises(RecordIOError, match=r"checksum mismatch \(stored 0x[0-9a-f]{8}, computed 0x") as info:
        shard.read(15, 16)
    assert_located(info.value, 1, bad.offset)
    with pytest.raises(RecordIOError, match="checksum mismatch"):
        shard.verify()
    assert isinstance(info.value, DataFormatError)


def test_bad_magic() -> None:
    storage, data, index = three_chunk_shard()
    bad = index.entries[2]
    set_u32(data, bad.offset, 0xDEADBEEF)
    storage.objects[KEY] = bytes(data)
    with pytest.raises(RecordIOError, match="bad magic number 0xdeadbeef") as info:
        ShardReader(storage, KEY).read(25, 26)
    assert_located(info.value, 2, bad.offset)
    del storage.objects[KEY + INDEX_SUFFIX]
    with pytest.raises(RecordIOError, match="bad magic") as info:
        ShardReader(storage, KEY)  # scanning stops at the bad header
    assert_located(info.value, 2, bad.offset)


def test_unknown_compressor() -> None:
    storage, data, index = three_chunk_shard()
    set_u32(data, index.entries[1].offset + 8, 7)
    storage.objects[KEY] = bytes(data)
    with pytest.raises(RecordIOError, match="unknown compressor 7") as info:
        ShardReader(storage, KEY).verify()
    assert_located(info.value, 1, index.entries[1].offset)


def test_truncated_header() -> None:
    storage, data, index = three_chunk_shard()
    last = index.entries[2]
    storage.objects[KEY] = bytes(data[: last.offset + 11])
    with pytest.raises(RecordIOError, match="truncated header: 11 of 20 bytes") as info:
        ShardReader(storage, KEY)  # stale sidecar (size changed): falls back to scanning
    assert_located(info.value, 2, last.offset)
    with pytest.raises(RecordIOError, match="truncated header"):
        parse_header(b"\x04\x03\x02\x01", file=URL, chunk=0, offset=0)


def test_truncated_payload() -> None:
    storage, data, index = three_chunk_shard(Compressor.GZIP)
    last = index.entries[2]
    storage.objects[KEY] = bytes(data[: last.end - 5])
    with pytest.raises(RecordIOError, match="truncated: header declares a") as info:
        ShardReader(storage, KEY)
    assert_located(info.value, 2, last.offset)
    # A reader holding the old index finds out when the shard comes back short.
    with pytest.raises(RecordIOError, match="truncated") as info:
        ShardReader(storage, KEY, index).read(29, 30)
    assert_located(info.value, 2, last.offset)
    with pytest.raises(RecordIOError, match="but its index describes"):
        ShardReader(storage, KEY, index).verify()


@pytest.mark.parametrize("compressor", list(Compressor))
@pytest.mark.parametrize(
    ("delta", "message"),
    [(1, "ends inside record 4 of the 5"), (-2, "left over after the 2"), (10**6, "holds at most")],
)
def test_lying_record_count(compressor: Compressor, delta: int, message: str) -> None:
    chunk = bytearray(encode_chunk([b"abc", b"", b"defg", b"h"], compressor))
    set_u32(chunk, 16, 4 + delta)  # the checksum covers the payload only, not the header
    with pytest.raises(RecordIOError, match=message) as info:
        decode_chunk(chunk, file=URL, chunk=4, offset=4096)
    assert_located(info.value, 4, 4096)


def test_record_length_overrunning_the_payload() -> None:
    chunk = bytearray(encode_chunk([b"abc", b"defg"], Compressor.NONE))
    set_u32(chunk, HEADER_SIZE, 1000)
    fix_crc(chunk, 0, len(chunk))
    with pytest.raises(RecordIOError, match="ends inside record 0 of the 2"):
        decode_chunk(chunk, file=URL, chunk=0, offset=0)


@pytest.mark.parametrize("compressor", [Compressor.SNAPPY, Compressor.GZIP])
def test_payload_that_does_not_decompress(compressor: Compressor) -> None:
    chunk = bytearray(encode_chunk([b"x" * 100], compressor))
    chunk[HEADER_SIZE + 2 :] = b"\x00garbage" * 4
    set_u32(chunk, 12, len(chunk) - HEADER_SIZE)
    fix_crc(chunk, 0, len(chunk))
    with pytest.raises(RecordIOError, match=f"{compressor.label} payload does not decompress"):
        decode_chunk(chunk, file=URL, chunk=0, offset=0)


def test_chunk_must_span_exactly_its_declared_size() -> None:
    chunk = encode_chunk([b"abc"], Compressor.NONE)
    with pytest.raises(RecordIOError, match="truncated: header declares a 7-byte payload, only 6"):
        decode_chunk(chunk[:-1], file=URL, chunk=0, offset=0)
    with pytest.raises(RecordIOError, match="chunk spans 8 bytes"):
        decode_chunk(chunk + b"\0", file=URL, chunk=0, offset=0)


# -- the index sidecar ------------------------------------------------------------------------------


def test_sidecar_round_trip_and_layout() -> None:
    storage, _ = uniform_shard(Compressor.GZIP, chunks=4)
    sidecar = storage.objects[KEY + INDEX_SUFFIX]
    index = ChunkIndex.from_bytes(sidecar, file="x")
    assert index.to_bytes() == sidecar
    assert len(sidecar) == 24 + 24 * 4 + 4
    assert sidecar[:12] == b"EDLRIDX\0" + struct.pack("<I", 1)
    assert struct.unpack_from("<IQ", sidecar, 12) == (4, len(storage.objects[KEY]))
    e = index.entries[1]
    assert struct.unpack_from("<QQII", sidecar, 24 + 24) == (e.offset, e.size, 10, Compressor.GZIP)
    assert (e.first_record, e.num_records) == (10, 10)
    assert struct.unpack_from("<I", sidecar, len(sidecar) - 4)[0] == zlib.crc32(sidecar[:-4])


def test_missing_sidecar_scans_headers_only() -> None:
    storage, _ = uniform_shard(Compressor.SNAPPY, chunks=4)
    with_sidecar = ShardReader(storage, KEY).index
    assert storage.shard_reads() == []  # the sidecar was enough
    del storage.objects[KEY + INDEX_SUFFIX]
    scanned = ShardReader(storage, KEY).index
    assert scanned == with_sidecar
    assert storage.shard_reads() == [(e.offset, HEADER_SIZE) for e in scanned.entries]


def test_stale_sidecar_falls_back_to_scanning() -> None:
    storage, _ = uniform_shard(chunks=4)
    old_sidecar = storage.objects[KEY + INDEX_SUFFIX]
    records = sample_records(40)
    write_shard(storage, KEY, records, max_chunk_bytes=1000)
    storage.objects[KEY + INDEX_SUFFIX] = old_sidecar  # describes a shard of another size
    shard = ShardReader(storage, KEY)
    assert shard.index == ChunkIndex.scan(
        lambda o, n: storage.objects[KEY][o : o + n], shard.index.file_size, file=URL
    )
    assert shard.read(0, 40) == records


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda b: b[:10], "truncated: 10 bytes"),
        (lambda b: b"NOTINDEX" + b[8:], "bad magic b'NOTINDEX'"),
        (lambda b: b[:8] + struct.pack("<I", 9) + b[12:], "unsupported version 9"),
        (lambda b: b + b"\0", "but 4 chunks need"),
        (lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], "checksum mismatch"),
    ],
)
def test_corrupt_sidecar_is_an_error_naming_it_and_the_reader_falls_back(
    tamper: Callable[[bytes], bytes], message: str
) -> None:
    storage, records = uniform_shard(chunks=4)
    sidecar_key = KEY + INDEX_SUFFIX
    storage.objects[sidecar_key] = tamper(storage.objects[sidecar_key])
    with pytest.raises(RecordIOError, match=message) as info:
        ChunkIndex.from_bytes(storage.objects[sidecar_key], file=storage.describe(sidecar_key))
    assert str(info.value).startswith(f"corrupt RecordIO index {URL}{INDEX_SUFFIX}: ")
    assert info.value.chunk is None
    assert ShardReader(storage, KEY).read(0, 40) == records


def test_sidecar_with_valid_checksum_but_impossible_layout() -> None:
    storage, _ = uniform_shard(chunks=2)
    index = ChunkIndex.from_bytes(storage.objects[KEY + INDEX_SUFFIX], file="x")
    body = bytearray(index.to_bytes()[:-4])
    struct.pack_into("<Q", body, 24 + 24, 5)  # chunk 1 no longer follows chunk 0
    with pytest.raises(RecordIOError, match="inconsistent chunk list: chunk 1 starts at byte 5"):
        ChunkIndex.from_bytes(bytes(body) + struct.pack("<I", zlib.crc32(body)), file="x")


def test_sidecar_of_another_shard_with_the_same_size_is_caught_when_reading() -> None:
    # Same chunk sizes, different record counts: the size check cannot tell, the chunk headers can.
    storage = MemStorage()
    write_shard(storage, KEY, [b"a" * 6, b"b" * 6, b"c" * 20], Compressor.NONE, max_chunk_bytes=20)
    other = MemStorage()
    write_shard(other, KEY, [b"x" * 16, b"y" * 20], Compressor.NONE, max_chunk_bytes=20)
    assert len(other.objects[KEY]) == len(storage.objects[KEY])
    storage.objects[KEY + INDEX_SUFFIX] = other.objects[KEY + INDEX_SUFFIX]
    shard = ShardReader(storage, KEY)
    with pytest.raises(
        RecordIOError, match=r"chunk header \(2 records, none\) disagrees with the index \(1 records, none\)"
    ) as info:
        shard.read(0, 1)
    assert_located(info.value, 0, 0)


# -- listing -------------------------------------------------------------------------------------------


def test_list_shards_skips_sidecars_temporaries_and_markers() -> None:
    storage = MemStorage()
    for key in [
        "data/b",
        "data/a",
        "data/a" + INDEX_SUFFIX,
        "data/.edl-tmp-123",
        "data/_COMPLETE",
        "data/sub/c",
        "data/_tmp/d",
        "other/e",
    ]:
        storage.objects[key] = b""
    # Only the base name decides: a shard inside a "_tmp" folder is still a shard.
    assert list_shards(storage, "data/") == ["data/_tmp/d", "data/a", "data/b", "data/sub/c"]
    assert list_shards(storage) == [*list_shards(storage, "data/"), "other/e"]


def test_local_storage_round_trip(tmp_path: Path) -> None:
    from edl_argo.storage import LocalStorage

    storage = LocalStorage(tmp_path)
    records = sample_records(50)
    write_shard(storage, "ds/shard-0", records, max_chunk_bytes=2048)
    write_shard(storage, "ds/shard-1", [])
    assert list_shards(storage, "ds") == ["ds/shard-0", "ds/shard-1"]
    shard = ShardReader(storage, "ds/shard-0")
    assert shard.read(3, 47) == records[3:47]
    assert shard.verify().records == 50


# -- compatibility with the reference layout ------------------------------------------------------------


def reference_chunk(records: list[bytes], compressor: int, *, per_write_frames: bool = False) -> bytes:
    """One chunk laid out as github.com/wangkuiyi/recordio writes it, built without edl_argo's code.

    ``per_write_frames`` mimics Go's unbuffered ``snappy.NewWriter``: every Write (a length, a record) is
    framed separately, so the stream holds many frames and repeated stream identifiers.
    """
    pieces = []
    for record in records:
        pieces += [struct.pack("<I", len(record)), record]
    raw = b"".join(pieces)
    if compressor == 0:
        stored = raw
    elif compressor == 1 and per_write_frames:
        stored = b"".join(bytes(cramjam.snappy.compress(p)) for p in pieces if p)
    elif compressor == 1:
        stored = bytes(cramjam.snappy.compress(raw))
    else:
        stored = gzip.compress(raw, compresslevel=9, mtime=1_600_000_000)
    header = struct.pack(
        "<IIIII", 0x01020304, zlib.crc32(stored) & 0xFFFFFFFF, compressor, len(stored), len(records)
    )
    return header + stored


def test_reads_a_file_written_by_an_independent_reference_layout_writer() -> None:
    records = sample_records(60, seed=7)
    groups = [records[0:10], records[10:25], records[25:26], records[26:45], records[45:60]]
    chunks = [
        reference_chunk(groups[0], 0),
        reference_chunk(groups[1], 1),
        reference_chunk(groups[2], 2),
        reference_chunk(groups[3], 1, per_write_frames=True),
        reference_chunk(groups[4], 2),
    ]
    storage = MemStorage()
    storage.objects[KEY] = b"".join(chunks)
    shard = ShardReader(storage, KEY)  # no sidecar: scanned
    assert [e.num_records for e in shard.index.entries] == [10, 15, 1, 19, 15]
    assert [e.size for e in shard.index.entries] == [len(c) for c in chunks]
    assert shard.read(0, 60) == records
    assert shard.read(24, 27) == records[24:27]
    assert shard.verify().compressors == {"gzip": 2, "none": 1, "snappy": 2}
    # And the project's own chunks have the same layout as the reference's.
    for compressor in (0, 1, 2):
        ours = encode_chunk(groups[1], Compressor(compressor))
        assert ours[:4] == reference_chunk(groups[1], compressor)[:4] == struct.pack("<I", MAGIC)
    assert encode_chunk(groups[0], Compressor.NONE) == reference_chunk(groups[0], 0)
    assert encode_chunk(groups[1], Compressor.SNAPPY) == reference_chunk(groups[1], 1)


# -- fuzzing ---------------------------------------------------------------------------------------------


def _valid_file(compressor: Compressor) -> tuple[bytes, bytes]:
    buffer = io.BytesIO()
    with RecordIOWriter(buffer, compressor, max_chunk_bytes=64) as writer:
        for record in sample_records(12, seed=3):
            writer.write(record[:50])
    assert writer.index is not None
    return buffer.getvalue(), writer.index.to_bytes()


VALID_FILES = {compressor: _valid_file(compressor) for compressor in Compressor}


def exercise_reader(shard: bytes, sidecar: bytes | None) -> None:
    """Use every reading entry point; only RecordIOError may come out."""
    storage = MemStorage()
    storage.objects[KEY] = shard
    if sidecar is not None:
        storage.objects[KEY + INDEX_SUFFIX] = sidecar
    with contextlib.suppress(RecordIOError):
        shard_reader = ShardReader(storage, KEY)
        n = shard_reader.num_records
        shard_reader.read(n // 2, n)
        list(shard_reader.iter_records())
        shard_reader.verify()


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(shard=st.binary(max_size=300), sidecar=st.none() | st.binary(max_size=200))
def test_fuzz_arbitrary_bytes(shard: bytes, sidecar: bytes | None) -> None:
    exercise_reader(shard, sidecar)
    exercise_reader(b"\x04\x03\x02\x01" + shard, None)  # get past the magic number more often
    with contextlib.suppress(RecordIOError):
        decode_chunk(shard, file=URL, chunk=0, offset=0)
    with contextlib.suppress(RecordIOError):
        ChunkIndex.from_bytes(b"EDLRIDX\0\x01\0\0\0" + shard, file="x")


@st.composite
def mutated_files(draw: st.DrawFn) -> tuple[bytes, bytes | None]:
    compressor = draw(st.sampled_from(list(Compressor)))
    valid, sidecar = VALID_FILES[compressor]
    data = bytearray(valid)
    for pos, value in draw(
        st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)), max_size=4)
    ):
        data[pos] = value
    if draw(st.booleans()):  # re-checksum, so that damage reaches decompression and record splitting
        for entry in ChunkIndex.from_bytes(sidecar, file="x").entries:
            fix_crc(data, entry.offset, entry.end)
    if draw(st.booleans()):  # cut it short and/or append junk
        data = data[: draw(st.integers(0, len(data)))] + draw(st.binary(max_size=30))
    return bytes(data), draw(st.sampled_from([None, sidecar]))


@FUZZ
@given(case=mutated_files())
def test_fuzz_mutated_valid_files(case: tuple[bytes, bytes | None]) -> None:
    exercise_reader(*case)
