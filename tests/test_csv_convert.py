"""``edl-argo data convert``: values kept exactly, clashes and missing values refused, errors at the
file's line."""

from __future__ import annotations

from pathlib import Path

import pytest

from edl_argo.cli import main
from edl_argo.data.examples import decode_example
from edl_argo.recordio import ShardReader, open_dataset
from edl_argo.storage import LocalStorage


def convert(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str | bytes, *flags: str, label: str = "y"
) -> tuple[int, str, list[dict[str, list]]]:
    """Convert ``text`` as a CSV file; (exit code, stderr's error line, the records written)."""
    source = tmp_path / "input.csv"
    source.write_bytes(text if isinstance(text, bytes) else text.encode())
    output = tmp_path / "out"
    code = main(
        ["data", "convert", "--from", str(source), "--label-column", label, "--output", str(output), *flags]
    )
    err = "\n".join(line for line in capsys.readouterr().err.splitlines() if "error:" in line)
    if code != 0:
        assert not output.exists() or not any(output.rglob("*")), "a refused conversion wrote something"
        return code, err, []
    dataset = open_dataset(LocalStorage(output))
    records = [
        decode_example(record)
        for key in dataset.records
        for record in ShardReader(dataset.storage, key).iter_records()
    ]
    return code, err, records


def test_integers_stay_int64_and_floats_and_text_keep_their_type(capsys, tmp_path: Path) -> None:
    text = 'id,price,name,y\n123456789,1.5,a,0\n9007199254740993,-2e3,b b,1\n-7,.25,"c,d",2\n'
    code, _, records = convert(capsys, tmp_path, text, "--shards", "2")
    assert code == 0
    assert [r["id"] for r in records] == [[123456789], [9007199254740993], [-7]]  # int64, exactly
    assert [r["price"] for r in records] == [[1.5], [-2000.0], [0.25]]
    assert [r["name"] for r in records] == [[b"a"], [b"b b"], [b"c,d"]]
    assert [r["label"] for r in records] == [[0], [1], [2]]


@pytest.mark.parametrize("token", ["nan", "inf", "-Infinity", "1_000", "0x10", "1e999"])
def test_words_python_parses_as_floats_are_not_numbers(capsys, tmp_path: Path, token: str) -> None:
    code, _, records = convert(capsys, tmp_path, f"x,y\n1.5,0\n{token},1\n")
    assert code == 0
    assert [r["x"] for r in records] == [[b"1.5"], [token.encode()]]  # the column is text, nothing invented


def test_a_feature_named_like_the_label_is_refused(capsys, tmp_path: Path) -> None:
    code, err, _ = convert(capsys, tmp_path, "label,y\n1,0\n")
    assert code == 2 and "'label'" in err and "input.csv" in err and "clashes" in err


def test_duplicate_and_empty_column_names_are_refused(capsys, tmp_path: Path) -> None:
    code, err, _ = convert(capsys, tmp_path, "a,b,a,y\n1,2,3,0\n")
    assert code == 2 and "duplicate" in err and "'a'" in err and "input.csv" in err
    code, err, _ = convert(capsys, tmp_path, "a,,y\n1,2,0\n")
    assert code == 2 and "column 2 has no name" in err


def test_a_missing_value_is_refused_with_line_and_column_or_filled(capsys, tmp_path: Path) -> None:
    text = "a,b,y\n1,2,0\n3,,1\n"
    code, err, _ = convert(capsys, tmp_path, text)
    assert code == 2 and "line 3" in err and "column 'b'" in err and "--fill-missing" in err
    code, err, _ = convert(capsys, tmp_path, text, "--fill-missing", "")  # empty: no fill (Argo's default)
    assert code == 2 and "line 3" in err and "column 'b'" in err
    code, _, records = convert(capsys, tmp_path, text, "--fill-missing", "0")
    assert code == 0 and [r["b"] for r in records] == [[2], [0]]  # still an int64 column


def test_line_numbers_count_lines_of_the_file_not_rows(capsys, tmp_path: Path) -> None:
    text = 'a,b,y\n1,"two\nlines",0\n"three\n\nlines",x,1\n4,5\n'
    code, err, _ = convert(capsys, tmp_path, text)
    assert code == 2 and "line 7" in err and "2 fields, the header has 3" in err


def test_a_byte_order_mark_and_trailing_blank_lines_are_accepted(capsys, tmp_path: Path) -> None:
    code, _, records = convert(capsys, tmp_path, b"\xef\xbb\xbfa,y\r\n1,0\r\n2,1\r\n\r\n\n")
    assert code == 0 and [r["a"] for r in records] == [[1], [2]]


def test_a_blank_line_between_rows_is_named(capsys, tmp_path: Path) -> None:
    code, err, _ = convert(capsys, tmp_path, "a,y\n1,0\n\n2,1\n")
    assert code == 2 and "line 3" in err and "blank" in err


def test_a_large_quoted_field_is_accepted(capsys, tmp_path: Path) -> None:
    big = "x" * 200_000
    code, _, records = convert(capsys, tmp_path, f'text,y\n"{big}\n{big}",1\n')
    assert code == 0 and records[0]["text"] == [f"{big}\n{big}".encode()]


def test_malformed_csv_and_bad_encoding_name_the_line(capsys, tmp_path: Path) -> None:
    code, err, _ = convert(capsys, tmp_path, 'a,y\n1,0\n"open,1\n', "--shards", "1")
    assert code == 2 and "input.csv" in err and "line 3" in err
    code, err, _ = convert(capsys, tmp_path, b"a,y\n1,0\n2,\xff\n")
    assert code == 2 and "input.csv" in err and "line 3" in err and "UTF-8" in err
