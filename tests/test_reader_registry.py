"""The reader registry (edl_argo/readers/registry.py): how a dataset's format is found, which options each
format takes, and ``--data-options`` parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.readers import FORMATS, open_data, parse_data_options
from edl_argo.readers.registry import data_format, detect_format


def touch(path: Path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["a.csv", "b/c.csv"], "csv"),
        (["a.parquet"], "parquet"),
        (["x.tfrecord", "y.tfrecords", "z.tfrecord.gz"], "tfrecord"),
        (["cat/1.png", "dog/2.JPG"], "images"),
        (["data-00000", "data-00000.edl-index"], "recordio"),
        (["README.md"], "recordio"),  # nothing recognised: RecordIO, whose reader names the missing manifest
        ([], "recordio"),
    ],
)
def test_the_format_is_found_from_the_file_names(tmp_path: Path, names: list[str], expected: str) -> None:
    tmp_path.mkdir(exist_ok=True)
    for name in names:
        touch(tmp_path / name)
    assert detect_format(str(tmp_path)) == expected


def test_a_database_url_is_sql_and_a_manifest_names_its_format(tmp_path: Path) -> None:
    assert detect_format("sqlite:////tmp/x.db#t") == "sql"
    assert detect_format("postgresql+psycopg2://u@h:5432/db#SELECT 1") == "sql"
    touch(tmp_path / "a.csv")
    touch(tmp_path / "_edl-dataset.json", b'{"data_format": "csv"}')
    assert detect_format(str(tmp_path)) == "csv"


def test_files_of_several_formats_are_refused_naming_them_and_the_flag(tmp_path: Path) -> None:
    touch(tmp_path / "a.csv")
    touch(tmp_path / "b.parquet")
    with pytest.raises(
        ConfigError, match=r"--training-data .*of several formats there \(csv, parquet\); pass --data-format"
    ):
        open_data(str(tmp_path), what="--training-data")


@pytest.mark.parametrize("name", [name for name in FORMATS if data_format(name).options is not None])
def test_each_format_refuses_an_option_it_does_not_take_listing_those_it_does(name: str) -> None:
    accepted = data_format(name).options
    with pytest.raises(
        ConfigError, match=rf"--data-options bogus: not an option of {name} data \(it takes: "
    ):
        open_data("/nonexistent", name, {"bogus": "1", **dict.fromkeys(accepted[:1], "")})


def test_data_options_parse_as_key_value_pairs() -> None:
    assert parse_data_options("key=id; columns=a,b ;;fill_missing=0") == {
        "key": "id",
        "columns": "a,b",
        "fill_missing": "0",
    }
    with pytest.raises(ConfigError, match="'columns' is not key=value"):
        parse_data_options("key=id;columns")


def test_an_unknown_format_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="--data-format 'xml' is not one of recordio, tfrecord"):
        open_data("/tmp", "xml")


def test_a_recordio_folder_without_manifest_says_how_to_seal_it(tmp_path: Path) -> None:
    touch(tmp_path / "data-00000")
    with pytest.raises(DataFormatError, match=r"no manifest .*edl-argo data seal"):
        open_data(str(tmp_path), what="--training-data")
