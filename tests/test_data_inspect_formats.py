"""``edl-argo data inspect`` and ``data seal`` of TFRecord, CSV and Parquet datasets, and sealed folders.

Inspect prints the format, every shard's records, the total and the schema, and reads every record through
the format's reader: a bad value or a corrupt record is one error line naming the file (and line). Seal
writes a manifest with ``data_format``; from then on the format is detected from it, readers take exactly
the files it names, and a named file that is missing or changed size is refused, naming it.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from edl_argo import cli
from edl_argo.errors import ConfigError, DataFormatError
from edl_argo.readers import detect_format, open_data
from edl_argo.readers.tfrecord import frame
from edl_argo.recordio import MANIFEST_NAME
from edl_argo.recordio.dataset import DatasetManifest, ShardEntry

ROWS = (30, 45)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    """Exit code, stdout lines and the error lines of stderr (not log events) of ``edl-argo argv``."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line and not line[:4].isdigit()]
    return code, captured.out.splitlines(), errors


def write_csv(folder: Path, bad_line: int = 0) -> Path:
    """Two CSV files of ``ROWS`` rows (x float, n int, label int); line ``bad_line`` of the second (the
    header is line 1) has x = "oops"."""
    folder.mkdir(parents=True)
    for number, rows in enumerate(ROWS):
        with (folder / f"part-{number}.csv").open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["x", "n", "label"])
            for i in range(rows):
                x = "oops" if number == 1 and i + 2 == bad_line else f"{i * 0.5}"
                writer.writerow([x, i, i % 3])
    return folder


def write_tfrecord(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for number, rows in enumerate(ROWS):
        data = b"".join(frame(f"record {number}-{i}".encode()) for i in range(rows))
        (folder / f"part-{number}.tfrecord").write_bytes(data)
    return folder


def write_parquet(folder: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    for number, rows in enumerate(ROWS):
        table = pa.table({"x": pa.array([i * 0.5 for i in range(rows)]), "label": pa.array(range(rows))})
        pq.write_table(table, folder / f"part-{number}.parquet", row_group_size=10)
    return folder


WRITERS = {"csv": write_csv, "tfrecord": write_tfrecord, "parquet": write_parquet}
SCHEMAS = {
    "csv": "schema: x float32, n int64, label int64",
    "tfrecord": "schema: serialized records",
    "parquet": "schema: x float64, label int64",
}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_inspect_prints_format_shards_total_and_schema_and_says_unsealed(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = WRITERS[fmt](tmp_path / fmt)
    code, out, errors = run_cli(capsys, "data", "inspect", str(folder))
    assert code == 0, errors
    assert out[0] == f"format: {fmt}"
    suffix = folder.glob("part-0.*").__next__().suffix
    assert out[2].split() == [f"part-0{suffix}", str(ROWS[0])]
    assert out[3].split() == [f"part-1{suffix}", str(ROWS[1])]
    assert out[4].split() == ["total", "(2", "shards)", str(sum(ROWS)), "ok"]
    assert out[5].startswith(SCHEMAS[fmt]), out[5]
    assert out[6].startswith("not sealed:") and f"edl-argo data seal {folder}" in out[6]
    assert not (folder / MANIFEST_NAME).exists()


def test_inspect_summarizes_many_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "many"
    folder.mkdir()
    for number in range(25):
        (folder / f"f-{number:02d}.tfrecord").write_bytes(b"".join(frame(b"r") for _ in range(number + 1)))
    code, out, _ = run_cli(capsys, "data", "inspect", str(folder))
    assert code == 0
    assert out[2].split() == ["f-00.tfrecord", "1"] and out[21].split() == ["f-19.tfrecord", "20"]
    assert out[22] == "... 5 more shards (records per shard: min 1, max 25, mean 13.0)"
    assert out[23].split()[-2:] == [str(25 * 26 // 2), "ok"]


def test_inspect_names_the_file_and_line_of_a_bad_csv_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The value is bad for the type the schema option gives: found reading the file through."""
    folder = write_csv(tmp_path / "csv", bad_line=17)
    code, _, errors = run_cli(capsys, "data", "inspect", str(folder), "--data-options", "schema=x:float32")
    assert code == 2 and len(errors) == 1, errors
    assert "part-1.csv" in errors[0] and "line 17" in errors[0] and "'x'" in errors[0], errors


def test_inspect_names_the_file_of_a_tfrecord_checksum_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_tfrecord(tmp_path / "tfrecord")
    path = folder / "part-1.tfrecord"
    data = bytearray(path.read_bytes())
    data[len(frame(b"record 1-0")) * 3 + 14] ^= 0xFF  # inside the data of the fourth record
    path.write_bytes(bytes(data))
    code, _, errors = run_cli(capsys, "data", "inspect", str(folder))
    assert code == 2 and len(errors) == 1, errors
    assert "part-1.tfrecord" in errors[0] and "fails its checksum" in errors[0], errors


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_seal_writes_a_manifest_that_names_every_file(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import hashlib

    folder = WRITERS[fmt](tmp_path / fmt)
    code, out, errors = run_cli(capsys, "data", "seal", str(folder))
    assert code == 0, errors
    assert out[-1].startswith(f"sealed 2 {fmt} files ({sum(ROWS)} records)")
    document = json.loads((folder / MANIFEST_NAME).read_text())
    assert document["data_format"] == fmt and document["records"] == sum(ROWS)
    files = sorted(path for path in folder.iterdir() if path.name != MANIFEST_NAME)
    assert document["shards"] == [
        {
            "key": path.name,
            "records": rows,
            "bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
        for path, rows in zip(files, ROWS, strict=True)
    ]
    assert detect_format(str(folder)) == fmt
    code, out, _ = run_cli(capsys, "data", "inspect", str(folder))
    assert code == 0 and out[-1].startswith("sealed: every file matches the manifest")
    # a folder with a manifest is not sealed again
    code, _, errors = run_cli(capsys, "data", "seal", str(folder))
    assert code == 2 and len(errors) == 1 and "is a dataset manifest already" in errors[0], errors


def test_a_sealed_folder_is_read_as_its_manifest_names_it(tmp_path: Path) -> None:
    """A file added later is not read; a named file that changed size or is gone is refused, naming it."""
    folder = write_csv(tmp_path / "csv")
    assert cli.main(["data", "seal", str(folder)]) == 0
    (folder / "late.csv").write_text("x,n,label\n1.0,1,1\n")
    data = open_data(str(folder))
    assert data.format == "csv" and data.records == {"part-0.csv": ROWS[0], "part-1.csv": ROWS[1]}
    with (folder / "part-1.csv").open("a") as file:
        file.write("9.5,9,0\n")
    with pytest.raises(DataFormatError, match=r"part-1\.csv has \d+ bytes, its manifest says \d+"):
        open_data(str(folder))
    (folder / "part-1.csv").unlink()
    with pytest.raises(DataFormatError, match=r"part-1\.csv named by its manifest is missing"):
        open_data(str(folder))


def test_inspect_finds_a_sealed_file_changed_in_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_tfrecord(tmp_path / "tfrecord")
    assert cli.main(["data", "seal", str(folder)]) == 0
    capsys.readouterr()
    path = folder / "part-0.tfrecord"
    path.write_bytes(path.read_bytes().replace(frame(b"record 0-5"), frame(b"record 0-6")))
    code, _, errors = run_cli(capsys, "data", "inspect", str(folder))
    assert code == 2 and len(errors) == 1, errors
    assert "part-0.tfrecord does not match the folder's manifest" in errors[0], errors


def test_a_sealed_folder_refuses_another_format(tmp_path: Path) -> None:
    folder = write_csv(tmp_path / "csv")
    assert cli.main(["data", "seal", str(folder)]) == 0
    with pytest.raises(ConfigError, match=r"manifest .* is of csv data, not tfrecord"):
        open_data(str(folder), "tfrecord")
    with pytest.raises(ConfigError, match=r"manifest .* is of csv data, not RecordIO"):
        open_data(str(folder), "recordio")


def test_seal_refuses_one_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_csv(tmp_path / "csv")
    code, _, errors = run_cli(capsys, "data", "seal", str(folder / "part-0.csv"))
    assert code == 2 and len(errors) == 1 and "seal the folder" in errors[0], errors


def test_a_recordio_manifest_has_no_data_format() -> None:
    """Existing manifests are unchanged: RecordIO's leaves the field out, and reads as RecordIO."""
    manifest = DatasetManifest((ShardEntry("data-00000", 3, 10, "ab"),), "2026-01-01T00:00:00Z")
    assert "data_format" not in json.loads(manifest.to_bytes())
    assert DatasetManifest.from_bytes(manifest.to_bytes(), url="m").data_format == "recordio"
    csv_manifest = DatasetManifest(manifest.shards, manifest.created, "csv")
    assert DatasetManifest.from_bytes(csv_manifest.to_bytes(), url="m") == csv_manifest
