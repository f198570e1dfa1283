"""RecordIO reads of task-sized record ranges through :class:`ShardReader` vs raw reads of the same bytes.

See :func:`_result` for the method; the report repeats it.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cramjam
import numpy as np

from edl_argo.recordio import HEADER_SIZE, INDEX_SUFFIX, ChunkIndex, Compressor, ShardReader, write_shard
from edl_argo.storage import LocalStorage, S3Storage, Storage
from tests.bench.common import BenchContext, BenchResult, Goal, Stat, environment, ratio_stat

RECORD_BYTES = 1024
RANGE_RECORDS = 512
CONFIGS = (
    (Compressor.NONE, 1 << 20),
    (Compressor.NONE, 64 << 10),
    (Compressor.SNAPPY, 1 << 20),
    (Compressor.SNAPPY, 64 << 10),
)
GOAL = 0.8


@dataclass(frozen=True)
class Shard:
    """One shard written for the benchmark: where it is and its index."""

    compressor: Compressor
    chunk_bytes: int
    key: str
    index: ChunkIndex
    raw_bytes: int

    @property
    def label(self) -> str:
        chunk = (
            f"{self.chunk_bytes >> 20} MiB"
            if self.chunk_bytes >= 1 << 20
            else f"{self.chunk_bytes >> 10} KiB"
        )
        return f"{self.compressor.label}, {chunk} chunks"


def make_records(count: int, seed: int = 0) -> list[bytes]:
    """``count`` text-like records of :data:`RECORD_BYTES` bytes: ``feature_NN=<12 random digits>;`` fields,
    padded with spaces (snappy stores about 0.6 of them, as it does with many real records)."""
    rng = np.random.default_rng(seed)
    fields = b"".join(b"feature_%02d=%s;" % (number, b"#" * 12) for number in range(44))
    template = np.frombuffer(fields[:RECORD_BYTES].ljust(RECORD_BYTES, b" "), dtype=np.uint8)
    slots = np.flatnonzero(template == ord("#"))
    rows = np.tile(template, (count, 1))
    rows[:, slots] = rng.integers(ord("0"), ord("9") + 1, size=(count, slots.size), dtype=np.uint8)
    return [row.tobytes() for row in rows]


_prepared: dict[Path, tuple[Path, list[Shard]]] = {}


def prepare_shards(ctx: BenchContext) -> tuple[Path, list[Shard]]:
    """Write one shard per configuration into a local folder (once per run); returns the folder."""
    if ctx.workdir not in _prepared:
        folder = ctx.folder("recordio")
        storage = LocalStorage(folder)
        count = (4 << 20 if ctx.quick else 64 << 20) // RECORD_BYTES
        records = make_records(count)
        shards = []
        for compressor, chunk_bytes in CONFIGS:
            key = f"shard-{compressor.label}-{chunk_bytes}"
            index = write_shard(storage, key, records, compressor=compressor, max_chunk_bytes=chunk_bytes)
            shards.append(Shard(compressor, chunk_bytes, key, index, count * (RECORD_BYTES + 4)))
        _prepared[ctx.workdir] = (folder, shards)
    return _prepared[ctx.workdir]


@dataclass
class Measured:
    """Records per second of the reader and of the raw reads, one value per repeat."""

    reader: list[float]
    raw: list[float]
    bytes_per_range: float
    #: Microseconds per range spent in CRC-32 and in decompression (the reader's two bulk steps).
    crc_us: float = 0.0
    decompress_us: float = 0.0


def bulk_costs(shard: Shard, raw_read: Callable[[int, int], bytes], starts: list[int]) -> tuple[float, float]:
    """Microseconds per range of ``zlib.crc32`` and of decompressing every chunk the range's read covers:
    the two steps of :meth:`ShardReader.read` that touch every byte (the rest walks records in Python)."""
    index = shard.index
    crc_seconds = decompress_seconds = 0.0
    for start in starts:
        span = index.chunk_span(start, start + RANGE_RECORDS)
        offset, length = index.span_bytes(span)
        data = memoryview(raw_read(offset, length))
        for number in span:
            entry = index.entries[number]
            payload = data[entry.offset - offset + HEADER_SIZE : entry.end - offset]
            began = time.perf_counter()
            zlib.crc32(payload)
            crc_seconds += time.perf_counter() - began
            if entry.compressor is Compressor.SNAPPY:
                began = time.perf_counter()
                cramjam.snappy.decompress(payload)
                decompress_seconds += time.perf_counter() - began
    return crc_seconds / len(starts) * 1e6, decompress_seconds / len(starts) * 1e6


def measure(
    shard: Shard,
    reader: ShardReader,
    raw_read: Callable[[int, int], bytes],
    ranges: int,
    repeats: int,
    seed: int = 0,
) -> Measured:
    """Time ``ranges`` random 512-record ranges per repeat, reader and raw paired on the same bytes."""
    rng = np.random.default_rng(seed)
    index = shard.index
    measured = Measured([], [], 0.0)
    total_bytes = 0
    for start in rng.integers(0, index.num_records - RANGE_RECORDS, size=3):  # warm-up (connections)
        reader.read(int(start), int(start) + RANGE_RECORDS)
        raw_read(*index.span_bytes(index.chunk_span(int(start), int(start) + RANGE_RECORDS)))
    for _ in range(repeats):
        reader_seconds = raw_seconds = 0.0
        starts = rng.integers(0, index.num_records - RANGE_RECORDS, size=ranges)
        for number, start in enumerate(int(s) for s in starts):
            end = start + RANGE_RECORDS
            offset, length = index.span_bytes(index.chunk_span(start, end))
            total_bytes += length
            for which in (0, 1) if number % 2 else (1, 0):
                began = time.perf_counter()
                if which == 0:
                    got = len(reader.read(start, end))
                else:
                    got = RANGE_RECORDS if len(raw_read(offset, length)) == length else -1
                took = time.perf_counter() - began
                if got != RANGE_RECORDS:
                    raise RuntimeError(f"{shard.key}: range [{start}, {end}) read wrong ({which=}, {got=})")
                if which == 0:
                    reader_seconds += took
                else:
                    raw_seconds += took
        measured.reader.append(ranges * RANGE_RECORDS / reader_seconds)
        measured.raw.append(ranges * RANGE_RECORDS / raw_seconds)
    measured.bytes_per_range = total_bytes / (ranges * repeats)
    sample = [
        int(start) for start in rng.integers(0, index.num_records - RANGE_RECORDS, size=min(ranges, 50))
    ]
    measured.crc_us, measured.decompress_us = bulk_costs(shard, raw_read, sample)
    return measured


def _result(name: str, title: str, where: str, raw_text: str, shards: list[Shard]) -> BenchResult:
    records = shards[0].index.num_records
    return BenchResult(
        name=name,
        title=title,
        method=(
            f"One shard of {records:,} records of {RECORD_BYTES:,} bytes "
            f"({shards[0].raw_bytes / 2**20:.0f} MiB) per compressor and chunk size, written with "
            "`write_shard` (text-like records: 44 `feature_NN=<12 random digits>;` fields). Random ranges "
            "of 512 records are read "
            f"through `ShardReader.read(start, start + 512)` on {where}; paired with each, the same byte "
            f"range (the chunks holding those records, from the index) is read raw: {raw_text}. Both count "
            "512 records per range; the two reads of a pair alternate in order; each repeat draws new "
            "ranges. "
            "The last column splits the medians into µs per range; in parentheses, the time `zlib.crc32` and "
            "`cramjam.snappy.decompress` alone take on the chunks of 50 sample ranges (the reader checksums "
            "and decompresses every chunk it reads); the reader's remaining time is its Python walk over the "
            "length prefix of every record of those chunks, and copying records out."
        ),
        columns=[
            "shard",
            "stored ÷ records bytes",
            "KiB read per range",
            "raw records/s",
            "reader records/s",
            "reader ÷ raw",
            "µs per range: raw / reader (CRC-32, snappy)",
        ],
    )


def _row(shard: Shard, measured: Measured) -> dict[str, object]:
    return {
        "shard": shard.label,
        "stored ÷ records bytes": f"{shard.index.file_size / shard.raw_bytes:.2f}",
        "KiB read per range": f"{measured.bytes_per_range / 1024:,.0f}",
        "raw records/s": Stat.of(measured.raw),
        "reader records/s": Stat.of(measured.reader),
        "reader ÷ raw": ratio_stat(measured.reader, measured.raw),
        "µs per range: raw / reader (CRC-32, snappy)": (
            f"{RANGE_RECORDS / Stat.of(measured.raw).median * 1e6:,.0f} / "
            f"{RANGE_RECORDS / Stat.of(measured.reader).median * 1e6:,.0f} "
            f"({measured.crc_us:,.0f}, {measured.decompress_us:,.0f})"
        ),
    }


def recordio_local(ctx: BenchContext) -> BenchResult:
    """Reader vs ``open/seek/read`` of the same bytes, on a local folder (page cache warm)."""
    folder, shards = prepare_shards(ctx)
    result = _result(
        "recordio_local",
        "RecordIO reads, local folder",
        "a `LocalStorage` in the run's temporary folder (files in the page cache)",
        "`open(path, 'rb')`, `seek(offset)`, `read(length)`",
        shards,
    )
    storage = LocalStorage(folder)
    ranges, repeats = (20, 2) if ctx.quick else (300, 5)
    for shard in shards:
        path = folder / shard.key

        def raw_read(offset: int, length: int, path: Path = path) -> bytes:
            with path.open("rb") as file:
                file.seek(offset)
                return file.read(length)

        reader = ShardReader(storage, shard.key)
        measured = measure(shard, reader, raw_read, ranges, repeats)
        row = _row(shard, measured)
        result.rows.append(row)
        result.goals.append(Goal(f"local, {shard.label}: reader ≥ {GOAL}× raw", row["reader ÷ raw"], GOAL))
    return result


def recordio_s3(ctx: BenchContext) -> BenchResult:
    """Reader (through ``S3Storage``) vs one plain minio ranged GET of the same bytes, on the S3 stand-in."""
    from tests.s3_stand_in import S3StandIn

    folder, shards = prepare_shards(ctx)
    result = _result(
        "recordio_s3",
        "RecordIO reads, S3 (the test stand-in: s3rver behind a SigV4 check, on loopback)",
        "an `S3Storage` against the S3 stand-in the benchmark starts (`tests/s3_stand_in.py`, on loopback)",
        "one `Minio.get_object(bucket, name, offset, length)` + `read()` with a plain minio client",
        shards,
    )
    ranges, repeats = (5, 2) if ctx.quick else (40, 3)
    bucket = "bench"
    with S3StandIn() as server, environment({**server.env(), "AWS_SESSION_TOKEN": ""}):
        server.create_bucket(bucket)
        storage: Storage = S3Storage(f"s3://{bucket}/recordio")
        local = LocalStorage(folder)
        for shard in shards:
            for key in (shard.key, shard.key + INDEX_SUFFIX):
                storage.write(key, local.read(key))
        client = server.client()
        for shard in shards:
            name = f"recordio/{shard.key}"

            def raw_read(offset: int, length: int, name: str = name) -> bytes:
                response = client.get_object(bucket, name, offset=offset, length=length)
                try:
                    return response.read()
                finally:
                    response.close()
                    response.release_conn()

            reader = ShardReader(storage, shard.key)
            measured = measure(shard, reader, raw_read, ranges, repeats)
            row = _row(shard, measured)
            result.rows.append(row)
            result.goals.append(Goal(f"S3, {shard.label}: reader ≥ {GOAL}× raw", row["reader ÷ raw"], GOAL))
    return result
