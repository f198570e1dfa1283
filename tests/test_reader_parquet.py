"""Parquet files behind the reader contract (edl_argo/readers/parquet_files.py): footers and row groups
through ranged reads of pinned versions, Arrow types as column types, nulls, projection."""

from __future__ import annotations

import io
import itertools
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.readers import parquet_files, registry
from edl_argo.readers.base import OpenedDataset, ReaderSpec
from edl_argo.recordio.reader import ShardChangedError
from edl_argo.storage import open_storage


def _table(count: int, seed: int) -> pa.Table:
    rng = random.Random(seed)
    return pa.table(
        {
            "small": pa.array([rng.randint(-100, 100) for _ in range(count)], pa.int8()),
            "big": pa.array([rng.randint(-(2**62), 2**62) for _ in range(count)], pa.int64()),
            "f32": pa.array([rng.random() for _ in range(count)], pa.float32()),
            "f64": pa.array([rng.random() for _ in range(count)], pa.float64()),
            "flag": pa.array([rng.random() < 0.5 for _ in range(count)]),
            "name": pa.array([f"n{rng.randint(0, 9)}" for _ in range(count)]).dictionary_encode(),
            "blob": pa.array([bytes([i % 256]) * (i % 5) for i in range(count)], pa.binary()),
        }
    )


def _write(path: Path, table: pa.Table, row_group_size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)


def _cuts(count: int, seed: int) -> list[tuple[int, int]]:
    fixed = [(0, 1), (0, count), (99, 101), (100, 200), (count - 1, count), (7, 7)]
    rng = random.Random(seed)
    bounds = sorted({0, count, *rng.sample(range(1, count), 5)})
    return [(a, b) for a, b in fixed if b <= count] + list(itertools.pairwise(bounds))


def _assert_reads(opened: OpenedDataset, expected: dict[str, pa.Table]) -> None:
    reader = registry.range_reader(ReaderSpec.from_json(opened.spec.to_json()))
    dtypes = {
        "int64": np.int64,
        "float32": np.float32,
        "float64": np.float64,
        "bool": np.bool_,
        "string": object,
    }
    for shard, table in expected.items():
        assert opened.records[shard] == table.num_rows
        for start, end in _cuts(table.num_rows, seed=table.num_rows):
            records = reader.read(
                shard, start, end, version=opened.versions[shard], hint=opened.locate(shard, start, end)
            )
            for column, values in zip(opened.schema.columns, records, strict=True):
                assert values.dtype == dtypes[column.dtype] and len(values) == end - start
                want = table.column(column.name).slice(start, end - start).to_pylist()
                assert values.tolist() == (
                    want if column.dtype != "float32" else [np.float32(v) for v in want]
                )


def test_every_range_reads_the_rows_written_through_the_spec_json(tmp_path: Path) -> None:
    a, b = _table(450, seed=1), _table(120, seed=2)
    _write(tmp_path / "a.parquet", a, row_group_size=100)
    _write(tmp_path / "sub" / "b.parquet", b, row_group_size=1000)
    opened = registry.open_data(str(tmp_path))
    assert opened.format == "parquet"
    assert [(c.name, c.dtype) for c in opened.schema.columns] == [
        ("small", "int64"),
        ("big", "int64"),
        ("f32", "float32"),
        ("f64", "float64"),
        ("flag", "bool"),
        ("name", "string"),
        ("blob", "string"),
    ]
    _assert_reads(opened, {"a.parquet": a, "sub/b.parquet": b})


def test_only_the_footer_and_the_row_groups_asked_for_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = pa.table(
        {"x": pa.array(range(100_000), pa.int64()), "pad": pa.array([str(i) * 3 for i in range(100_000)])}
    )
    _write(tmp_path / "big.parquet", table, row_group_size=10_000)
    size = (tmp_path / "big.parquet").stat().st_size
    read_bytes: list[int] = []
    original = parquet_files.RangedFile.read

    def counted(self: parquet_files.RangedFile, n: int | None = -1) -> bytes:
        data = original(self, n)
        read_bytes.append(len(data))
        return data

    monkeypatch.setattr(parquet_files.RangedFile, "read", counted)
    opened = registry.open_data(str(tmp_path), "parquet", {"columns": "x"})
    assert 0 < sum(read_bytes) < size / 10  # the footer only
    read_bytes.clear()
    reader = registry.range_reader(ReaderSpec.from_json(opened.spec.to_json()))
    (x,) = reader.read("big.parquet", 25_000, 25_010, version=opened.versions["big.parquet"])
    assert x.tolist() == list(range(25_000, 25_010))
    assert 0 < sum(read_bytes) < size / 5  # a footer and one row group's x column


def test_nulls_are_refused_with_file_column_and_row_or_filled(tmp_path: Path) -> None:
    table = pa.table({"k": pa.array([1, 2, None, 4], pa.int32()), "s": pa.array(["a", None, "c", "d"])})
    _write(tmp_path / "n.parquet", table, row_group_size=2)
    opened = registry.open_data(str(tmp_path), "parquet")
    with pytest.raises(
        DataFormatError, match=rf"^Parquet file {tmp_path}/n\.parquet row 2, column 'k': missing value"
    ):
        opened.read("n.parquet", 2, 4)
    with pytest.raises(DataFormatError, match=r"n\.parquet row 1, column 's'"):
        opened.read("n.parquet", 0, 2)
    filled = registry.open_data(str(tmp_path), "parquet", {"fill_missing": "0"})
    reader = registry.range_reader(ReaderSpec.from_json(filled.spec.to_json()))
    k, s = reader.read("n.parquet", 0, 4)
    assert k.tolist() == [1, 2, 0, 4] and s.tolist() == ["a", "0", "c", "d"]


def test_projection_and_unsupported_types(tmp_path: Path) -> None:
    table = pa.table({"when": pa.array([1, 2], pa.timestamp("s")), "v": [1.5, 2.5], "w": [1, 2]})
    _write(tmp_path / "t.parquet", table, row_group_size=10)
    with pytest.raises(
        ConfigError, match=r"column 'when' has type timestamp\[ms\]"
    ):  # Parquet stores s as ms
        registry.open_data(str(tmp_path), "parquet")
    opened = registry.open_data(str(tmp_path), "parquet", {"columns": "w,v"})
    assert opened.schema.names == ("w", "v")
    w, v = registry.range_reader(ReaderSpec.from_json(opened.spec.to_json())).read("t.parquet", 1, 2)
    assert w.tolist() == [2] and v.tolist() == [2.5]
    with pytest.raises(ConfigError, match=r"'z' is not a column of .*; columns: when, v, w"):
        registry.open_data(str(tmp_path), "parquet", {"columns": "z"})


def test_files_must_share_their_columns(tmp_path: Path) -> None:
    _write(tmp_path / "a.parquet", pa.table({"x": [1]}), 10)
    _write(tmp_path / "b.parquet", pa.table({"x": ["one"]}), 10)
    with pytest.raises(DataFormatError, match=rf"^Parquet file {tmp_path}/b\.parquet: its columns"):
        registry.open_data(str(tmp_path), "parquet")


def test_a_file_that_is_not_parquet(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataFormatError, match=r"x\.parquet: not readable as Parquet"):
        registry.open_data(str(tmp_path), "parquet")


def test_a_file_replaced_after_open_is_a_changed_shard(tmp_path: Path) -> None:
    _write(tmp_path / "a.parquet", _table(50, seed=3), 10)
    opened = registry.open_data(str(tmp_path), "parquet")
    _write(tmp_path / "a.parquet", _table(60, seed=4), 10)
    reader = registry.range_reader(ReaderSpec.from_json(opened.spec.to_json()))
    with pytest.raises(ShardChangedError, match=r"a\.parquet changed while this job was reading it"):
        reader.read("a.parquet", 0, 5, version=opened.versions["a.parquet"])


def test_the_ranged_file_object(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(bytes(range(100)))
    files = parquet_files.PinnedFiles(str(tmp_path))
    handle = parquet_files.RangedFile(files, "f")
    assert handle.seek(-10, io.SEEK_END) == 90 and handle.read(4) == bytes([90, 91, 92, 93])
    buffer = bytearray(20)
    assert handle.readinto(buffer) == 6 and bytes(buffer[:6]) == bytes(range(94, 100))
    assert handle.read() == b"" and handle.seek(0) == 0 and handle.read(3) == b"\x00\x01\x02"


def test_detection_and_an_s3_dataset(s3_env: str) -> None:
    table = _table(230, seed=5)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=64)
    open_storage(s3_env).write("pq/a.parquet", sink.getvalue().to_pybytes())
    assert registry.detect_format(s3_env + "/pq") == "parquet"
    opened = registry.open_data(s3_env + "/pq")
    _assert_reads(opened, {"a.parquet": table})
