"""CSV files behind the reader contract (edl_argo/readers/csv_files.py): the index a master builds and the
ranges a worker reads from the spec's JSON and a hint alone, with every error naming the file and line."""

from __future__ import annotations

import csv
import io
import itertools
import random
from pathlib import Path

import numpy as np
import pytest

from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.readers import csv_files, registry
from edl_argo.readers.base import OpenedDataset, ReaderSpec
from edl_argo.readers.files import INDEX_STRIDE
from edl_argo.recordio.reader import ShardChangedError
from edl_argo.storage import open_storage


def _rows(count: int, seed: int) -> list[tuple[int, float, str]]:
    rng = random.Random(seed)
    texts = ["plain", 'a "quoted" word', "two\nlines", "comma, inside", "three\nline\nfield", "", "üñí"]
    return [
        (rng.randint(-(10**12), 10**12), rng.randint(-400, 400) / 8, rng.choice(texts)) for _ in range(count)
    ]


def _csv_text(rows: list[tuple[int, float, str]], header: str = "id,value,text", crlf: bool = False) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n" if crlf else "\n")
    writer.writerow(header.split(","))
    writer.writerows(rows)
    return out.getvalue()


def _write(path: Path, text: str, bom: bool = False, tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + (text + tail).encode())


def _cuts(count: int, seed: int) -> list[tuple[int, int]]:
    """Ranges that start and end on and off index entries, at the file's ends, and a random partition."""
    fixed = [
        (0, 1),
        (0, count),
        (63, 65),
        (64, 128),
        (1, 64),
        (count - 1, count),
        (count - 70, count),
        (5, 5),
    ]
    rng = random.Random(seed)
    bounds = sorted({0, count, *rng.sample(range(1, count), 6)})
    return [(a, b) for a, b in fixed if 0 <= a <= b <= count] + list(itertools.pairwise(bounds))


def _assert_reads(opened: OpenedDataset, expected: dict[str, list[tuple[int, float, str]]]) -> None:
    """Every cut of every shard, read as a worker reads it (spec from JSON, with and without the hint)."""
    reader = registry.range_reader(ReaderSpec.from_json(opened.spec.to_json()))
    for shard, rows in expected.items():
        assert opened.records[shard] == len(rows)
        for start, end in _cuts(len(rows), seed=len(rows)):
            for hint in (opened.locate(shard, start, end), ""):
                ids, values, texts = reader.read(shard, start, end, version=opened.versions[shard], hint=hint)
                assert (ids.dtype, values.dtype, texts.dtype) == (np.int64, np.float32, object)
                want = rows[start:end]
                assert ids.tolist() == [r[0] for r in want], (shard, start, end, hint)
                assert values.tolist() == [np.float32(r[1]) for r in want]
                assert texts.tolist() == [r[2] for r in want]


def test_every_range_reads_the_rows_written_through_the_spec_json(tmp_path: Path) -> None:
    rows_a, rows_b = _rows(300, seed=1), _rows(129, seed=2)
    _write(tmp_path / "a.csv", _csv_text(rows_a), bom=True, tail="\n\n")
    _write(tmp_path / "sub" / "b.csv", _csv_text(rows_b, crlf=True), tail="\r\n")
    opened = registry.open_data(str(tmp_path))
    assert opened.format == "csv"
    assert [(c.name, c.dtype) for c in opened.schema.columns] == [
        ("id", "int64"),
        ("value", "float32"),
        ("text", "string"),
    ]
    assert opened.spec.url == str(tmp_path)
    _assert_reads(opened, {"a.csv": rows_a, "sub/b.csv": rows_b})


def test_one_file_url_and_the_line_numbers_the_hints_carry(tmp_path: Path) -> None:
    rows = [(i, 0.5, "x\ny" if i % 3 == 0 else "z") for i in range(200)]
    _write(tmp_path / "d" / "one.csv", _csv_text(rows))
    opened = registry.open_data(str(tmp_path / "d" / "one.csv"))
    assert opened.spec.url == str(tmp_path / "d") and list(opened.records) == ["one.csv"]
    index = opened.indexes["one.csv"]  # type: ignore[attr-defined]
    # Record r starts on line 2 + r + (records before it holding a newline), quoted newlines counted.
    assert index.lines.tolist() == [2 + r + len(range(0, r, 3)) for r in (0, 64, 128, 192)]
    assert index.records == 200 and len(index.offsets) == -(-200 // INDEX_STRIDE)
    _assert_reads(opened, {"one.csv": rows})


def test_the_index_scan_reads_in_bounded_blocks_with_the_same_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _rows(1000, seed=3)
    _write(tmp_path / "a.csv", _csv_text(rows), bom=True, tail="\n")
    whole = registry.open_data(str(tmp_path), "csv").indexes["a.csv"]  # type: ignore[attr-defined]
    sizes: list[int] = []
    storage_read = csv_files.PinnedFiles.read

    def counted(
        self: csv_files.PinnedFiles, key: str, offset: int = 0, length: int | None = None, version: str = ""
    ) -> bytes:
        sizes.append(-1 if length is None else length)
        return storage_read(self, key, offset, length, version)

    monkeypatch.setattr(csv_files.PinnedFiles, "read", counted)
    for block in (1, 2, 7, 64, 4096):
        monkeypatch.setattr(csv_files, "BLOCK_SIZE", block)
        sizes.clear()
        opened = registry.open_data(str(tmp_path), "csv")
        assert sizes and 0 < max(sizes) <= block  # never the whole file at once
        small = opened.indexes["a.csv"]  # type: ignore[attr-defined]
        assert (
            small.offsets.tolist() == whole.offsets.tolist() and small.lines.tolist() == whole.lines.tolist()
        )
        assert (
            (small.records, small.end)
            == (whole.records, whole.end)
            == (1000, (tmp_path / "a.csv").stat().st_size - 1)
        )
        assert len(small.offsets) == 1000 // INDEX_STRIDE + 1
        if block in (7, 4096):
            _assert_reads(opened, {"a.csv": rows})


def test_a_bad_value_names_the_file_line_and_column(tmp_path: Path) -> None:
    lines = ["id,value,text", '1,2.5,"a\nb"', '2,3.5,"c\n\nd"'] + [f"{i},1.0,x" for i in range(3, 100)]
    lines[70] = "70,1.0x,x"  # line 70 of the list is record 69, on file line 71 + 3 quoted newlines
    _write(tmp_path / "bad.csv", "\n".join(lines) + "\n")
    opened = registry.open_data(str(tmp_path), "csv", {"schema": "value:float32"})
    with pytest.raises(DataFormatError) as error:
        opened.read("bad.csv", 64, 80)
    assert str(error.value).startswith(
        f"CSV file {tmp_path}/bad.csv line 74, column 'value': '1.0x' is not float32"
    )
    reader = registry.range_reader(ReaderSpec.from_json(opened.spec.to_json()))
    with pytest.raises(DataFormatError, match=r"bad\.csv line 74, column 'value'"):
        reader.read("bad.csv", 60, 70)  # no hint: counted from the file's start
    assert reader.read("bad.csv", 0, 2)[2].tolist() == ["a\nb", "c\n\nd"]


def test_a_row_with_the_wrong_field_count_names_its_line(tmp_path: Path) -> None:
    _write(tmp_path / "f.csv", 'a,b\n1,2\n"x\ny",3\n4,5,6\n7,8\n')
    opened = registry.open_data(str(tmp_path), "csv")
    with pytest.raises(DataFormatError, match=r"^CSV file .*f\.csv line 5: 3 fields, the header has 2$"):
        opened.read("f.csv", 0, 4)
    assert opened.read("f.csv", 3, 4)[0].tolist() == ["7"]


def test_missing_numeric_values_are_refused_or_filled(tmp_path: Path) -> None:
    _write(tmp_path / "m.csv", "a,b\n1,x\n,y\n3,\n")
    opened = registry.open_data(str(tmp_path), "csv")
    assert opened.schema.dtypes == ("int64", "string")
    with pytest.raises(DataFormatError, match=r"m\.csv line 3, column 'a': missing value"):
        opened.read("m.csv", 0, 3)
    filled = registry.open_data(str(tmp_path), "csv", {"fill_missing": "-1"})
    a, b = filled.read("m.csv", 0, 3)
    assert a.tolist() == [1, -1, 3] and b.tolist() == ["x", "y", ""]


def test_headers_must_match_across_files(tmp_path: Path) -> None:
    _write(tmp_path / "a.csv", "x,y\n1,2\n")
    _write(tmp_path / "b.csv", "x,z\n1,2\n")
    with pytest.raises(
        DataFormatError, match=rf"^CSV file {tmp_path}/b\.csv line 1: header 'x,z' differs from 'x,y'"
    ):
        registry.open_data(str(tmp_path), "csv")


def test_malformed_files_are_refused_when_opened(tmp_path: Path) -> None:
    _write(tmp_path / "a.csv", "x,y\n1,2\n\n3,4\n")
    with pytest.raises(DataFormatError, match=r"a\.csv line 3: a blank line between rows"):
        registry.open_data(str(tmp_path), "csv")
    _write(tmp_path / "a.csv", 'x,y\n1,2\n3,"4\n5\n')
    with pytest.raises(DataFormatError, match=r"a\.csv line 3: a quoted field is not closed"):
        registry.open_data(str(tmp_path), "csv")
    _write(tmp_path / "a.csv", "x,y\n\n\n")
    with pytest.raises(DataFormatError, match=r"a\.csv has a header but no data rows"):
        registry.open_data(str(tmp_path), "csv")
    _write(tmp_path / "a.csv", "x,x\n1,2\n")
    with pytest.raises(DataFormatError, match=r"duplicate column names 'x'"):
        registry.open_data(str(tmp_path), "csv")


def test_projection_schema_and_delimiter_options(tmp_path: Path) -> None:
    _write(tmp_path / "t.csv", "a\tb\tc\n1\t2.5\tz\n3\t4\ty\n")
    opened = registry.open_data(
        str(tmp_path), "csv", {"delimiter": "\\t", "columns": "c,a", "schema": "a:float64"}
    )
    assert [(c.name, c.dtype) for c in opened.schema.columns] == [("c", "string"), ("a", "float64")]
    reader = registry.range_reader(ReaderSpec.from_json(opened.spec.to_json()))
    c, a = reader.read("t.csv", 0, 2, hint=opened.locate("t.csv", 0, 2))
    assert c.tolist() == ["z", "y"] and a.dtype == np.float64 and a.tolist() == [1.0, 3.0]
    with pytest.raises(
        ConfigError, match=r"^--data-options columns: 'd' is not a column of .*; columns: a, b, c$"
    ):
        registry.open_data(str(tmp_path), "csv", {"delimiter": "tab", "columns": "a,d"})
    with pytest.raises(ConfigError, match=r"type 'int8' of column 'a'"):
        registry.open_data(str(tmp_path), "csv", {"delimiter": "tab", "schema": "a:int8"})


def test_a_file_replaced_after_open_is_a_changed_shard(tmp_path: Path) -> None:
    _write(tmp_path / "a.csv", _csv_text(_rows(100, seed=4)))
    opened = registry.open_data(str(tmp_path), "csv")
    _write(tmp_path / "a.csv", _csv_text(_rows(100, seed=5)))
    with pytest.raises(ShardChangedError, match=r"a\.csv changed while this job was reading it"):
        opened.read("a.csv", 0, 10)


def test_detection(tmp_path: Path) -> None:
    _write(tmp_path / "a.csv", "x\n1\n")
    assert registry.detect_format(str(tmp_path)) == "csv"
    assert registry.detect_format(str(tmp_path / "a.csv")) == "csv"


def test_an_s3_dataset(s3_env: str) -> None:
    rows = _rows(150, seed=6)
    open_storage(s3_env).write("part/a.csv", b"\xef\xbb\xbf" + _csv_text(rows).encode())
    opened = registry.open_data(s3_env + "/part")
    assert opened.format == "csv"
    _assert_reads(opened, {"a.csv": rows})


def test_the_arrow_path_and_the_python_path_read_the_same_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker parses a located range with Arrow and falls back to Python's csv for anything unusual; both
    must give the same arrays, bit for bit, and the Arrow path must really be taken for clean data."""
    rng = np.random.default_rng(5)
    lines = ["i,f,d,s"]
    for n in range(700):
        text = rng.choice(["plain", 'say "hi"', "two\nlines", "a,b", "üñí", ""])
        quoted = '"' + text.replace('"', '""') + '"'
        number = float(rng.normal()) * 10.0 ** int(rng.integers(-30, 30))
        lines.append(f"{rng.integers(-(2**62), 2**62)},{number!r},{n / 7!r},{quoted}")
    _write(tmp_path / "d" / "x.csv", "\r\n".join(lines) + "\r\n")
    opened = registry.open_data(str(tmp_path / "d"), options={"schema": "d:float64"})
    assert [c.dtype for c in opened.schema.columns] == ["int64", "float32", "float64", "string"]
    reader = csv_files.CsvReader(opened.spec)
    taken = []
    arrow_rows = csv_files.CsvReader._arrow_rows

    def spy(self: csv_files.CsvReader, *args: object) -> object:
        result = arrow_rows(self, *args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(csv_files.CsvReader, "_arrow_rows", spy)
    cuts = [(0, 64), (3, 131), (64, 65), (600, 700)]
    fast = [reader.read("x.csv", a, b, hint=opened.locate("x.csv", a, b)) for a, b in cuts]
    assert taken == [True] * len(cuts)
    monkeypatch.setattr(csv_files.CsvReader, "_arrow_rows", lambda self, *args: None)
    slow = [reader.read("x.csv", a, b, hint=opened.locate("x.csv", a, b)) for a, b in cuts]
    for got, want in zip(fast, slow, strict=True):
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype
            assert list(g) == list(w) if g.dtype == object else np.array_equal(g, w)


@pytest.mark.parametrize("value", ["nan", "inf", "+3", " 7", "", "1_000"])
def test_values_arrow_would_take_differently_go_through_the_python_rules(tmp_path: Path, value: str) -> None:
    """NaN, infinities, a sign, spaces, a missing value: the Arrow path hands them to the Python path, which
    applies the documented rules (an error naming the line, or the value as the rules read it)."""
    rows = [f"{n},{n}.5" for n in range(100)]
    rows[70] = f"{value},1.5"
    _write(tmp_path / "d" / "x.csv", "a,b\n" + "\n".join(rows) + "\n")
    opened = registry.open_data(str(tmp_path / "d"), options={"schema": "a:int64"})
    if value in ("+3", " 7"):
        assert int(opened.read("x.csv", 64, 100)[0][6]) == int(value)
    else:
        with pytest.raises(DataFormatError, match=r"x\.csv line 72, column 'a'"):
            opened.read("x.csv", 64, 100)
