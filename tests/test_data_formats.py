"""`edl-argo data digits --format` and `edl-argo data census` (edl_argo/data/file_writers.py, census.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from edl_argo.data.census import COLUMNS
from edl_argo.readers import detect_format, open_data
from tests.test_cli import error_lines, run_cli


@pytest.mark.parametrize("fmt", ["tfrecord", "csv", "parquet", "images"])
def test_digits_in_each_file_format_hold_the_records_of_the_recordio_dataset(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for written in ("recordio", fmt):
        code, out, _ = run_cli(
            capsys, "data", "digits", "--output", str(tmp_path / written), "--format", written
        )
        assert code == 0 and out.startswith("wrote 1437 train and 360 test records"), out
    reference = open_data(str(tmp_path / "recordio" / "test"))
    expected = np.concatenate(
        [np.array(reference.read(s.key, 0, s.records)[0]) for s in reference.shards]
    )  # serialized Examples, in order
    url = str(tmp_path / fmt / "test")
    assert detect_format(url) == fmt  # what training and evaluation do with --data-format empty
    opened = open_data(url)
    assert sum(s.records for s in opened.shards) == 360
    if fmt == "tfrecord":
        records = np.concatenate([np.array(opened.read(s.key, 0, s.records)[0]) for s in opened.shards])
        assert list(records) == list(expected)
    elif fmt in ("csv", "parquet"):
        assert opened.schema.names == (*(f"p{i}" for i in range(64)), "label")
    else:  # class folders 0..9, named like the labels
        assert sorted(p.name for p in (tmp_path / fmt / "test").iterdir()) == [str(d) for d in range(10)]

    code, _, err = run_cli(capsys, "data", "digits", "--output", str(tmp_path / fmt), "--format", fmt)
    train = tmp_path / fmt / "train"
    assert code == 2 and error_lines(err) == [
        f"edl-argo data: error: {train} holds files already (pass --overwrite to replace them)"
    ]
    code, _, _ = run_cli(
        capsys, "data", "digits", "--output", str(tmp_path / fmt), "--format", fmt, "--overwrite"
    )
    assert code == 0


def test_census_table_is_written_once_replaced_with_overwrite_and_bad_input_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'sub' / 'census.db'}"  # the folder is made too
    census = ("data", "census", "--db", db, "--table", "census", "--rows", "300")
    code, out, _ = run_cli(capsys, *census)
    assert code == 0 and out == "wrote 300 census rows into table census\n"
    engine = sa.create_engine(db)
    with engine.connect() as connection:
        rows = connection.execute(sa.text("SELECT * FROM census ORDER BY id")).all()
    assert len(rows) == 300 and tuple(rows[0]._fields) == COLUMNS
    assert {row.income for row in rows} == {0, 1}

    cases = {
        census: "edl-argo data: error: table census exists (pass --overwrite to replace it)",
        ("data", "census", "--db", "sqlite:///x.db", "--table", "a b"): "edl-argo data: error: --db/--table",
        (
            "data",
            "census",
            "--db",
            "postgresql://u:hunter2@h/db",
            "--table",
            "t",
        ): "edl-argo data: error: --db",
        ("data", "census", "--db", "nonsense", "--table", "t"): "edl-argo data: error: ",
    }
    for argv, start in cases.items():
        code, _, err = run_cli(capsys, *argv)
        (line,) = error_lines(err)
        assert code == 2 and line.startswith(start), line
        assert "hunter2" not in err  # a password in the URL is refused without being shown
    code, _, _ = run_cli(capsys, *census, "--rows", "50", "--overwrite")
    with engine.connect() as connection:
        assert connection.execute(sa.text("SELECT COUNT(*) FROM census")).scalar() == 50
    engine.dispose()
