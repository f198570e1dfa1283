"""SQLFlow statements on a census-like table in each database (edl_argo/sqlflow/command.py).

The detailed test trains in this process through the same generated model file (the contract's
functions), published as a job publishes it, so that it is fast and deterministic; TO PREDICT and TO
EVALUATE then run exactly as the command runs them. ``test_to_train_runs_a_job`` runs the real local job
(master, PS, workers reading the SELECT through the SQL reader) and predicts with its model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
import tensorflow as tf
from contract_training import train_in_process
from sql_helpers import DATABASES, Tables, tables_of

from edl_argo.data.census import write_census
from edl_argo.errors import ConfigError, StorageError
from edl_argo.master.export import publish_model
from edl_argo.model import Mode
from edl_argo.readers import open_data
from edl_argo.sqlflow import command
from edl_argo.sqlflow.parser import parse
from edl_argo.sqlflow.premade import PremadeModel
from edl_argo.storage import open_storage
from tests.test_cli import error_lines, run_cli

db = pytest.fixture(params=DATABASES)(tables_of)
ROWS = 2000


def make_census(db: Tables, rows: int = ROWS, seed: int = 11) -> str:
    """A census table (edl_argo/data/census.py): age, workclass, education, hours_per_week and an income
    label computed from them with noise."""
    table = db.name("census")
    write_census(db.url, table, rows, seed)  # as `edl-argo data census` writes it
    return table


def train_here(plan: command.TrainPlan, db_url: str, select: str, model_dir: str, epochs: int = 6) -> None:
    """Train the plan's model file in this process and publish it where the job would (``<dir>/model``)."""
    namespace: dict = {}
    exec(compile(plan.model_file, "sqlflow_model.py", "exec"), namespace)
    premade: PremadeModel = namespace["_MODEL"]
    opened = open_data(f"{db_url}#{select}", "sql", {})
    records = opened.read("0", 0, opened.shards[0].records)
    tensors = {
        n: tf.constant(a.astype(str) if a.dtype == object else a)
        for n, a in zip(opened.schema.names, records, strict=True)
    }
    dataset = premade.feed(tf.data.Dataset.from_tensor_slices(tensors), Mode.TRAINING).shuffle(4096, seed=1)
    model = train_in_process(premade, dataset.batch(64), epochs)
    storage = open_storage(model_dir)
    storage.write(command.MODEL_FILE, plan.model_file.encode())
    publish_model(storage, model, {}, {})


def rows_of(db: Tables, table: str) -> list[dict]:
    with db.engine.connect() as connection:
        return [dict(row._mapping) for row in connection.execute(sa.text(f"SELECT * FROM {table}"))]


def has_table(db: Tables, table: str) -> bool:
    return sa.inspect(db.engine).has_table(table)


def test_train_predict_evaluate_on_a_census_table(db: Tables, tmp_path: Path) -> None:
    train_table, test_table = make_census(db), make_census(db, rows=500, seed=12)
    models = str(tmp_path / "models")
    statement = parse(
        f"SELECT * FROM {train_table} TO TRAIN DNNClassifier WITH model.hidden_units=[32, 16], "
        "model.learning_rate=0.01, train.epoch=2, train.batch_size=64, train.key=id "
        f"COLUMN age, NUMERIC(hours_per_week), CATEGORY_ID(workclass, 16), "
        f"EMBEDDING(CATEGORY_ID(education, 8), 4) LABEL income INTO census_model"
    )
    plan = command.plan_training(statement, db.url, models)
    assert plan.argv[:6] == [
        "--training-data",
        f"{db.url}#SELECT * FROM {train_table}",
        "--model-def",
        f"{models}/census_model/{command.MODEL_FILE}",
        "--output",
        f"{models}/census_model",
    ]
    assert plan.argv[6:] == ["--data-options", "key=id", "--num-epochs", "2", "--minibatch-size", "64"]
    train_here(plan, db.url, f"SELECT * FROM {train_table}", f"{models}/census_model")

    pred = db.name("pred")
    written = command.predict_statement(
        parse(
            f"SELECT id, age, workclass, education, hours_per_week FROM {test_table} "
            f"TO PREDICT {pred}.income USING census_model"
        ),
        db.url,
        models,
    )
    assert written == 500
    predicted = {row["id"]: row["income"] for row in rows_of(db, pred)}
    truth = {row["id"]: row["income"] for row in rows_of(db, test_table)}
    assert sorted(predicted) == sorted(truth)
    accuracy = np.mean([predicted[i] == truth[i] for i in truth])
    assert accuracy >= 0.8, accuracy
    assert set(rows_of(db, pred)[0]) == {"id", "age", "workclass", "education", "hours_per_week", "income"}

    evaluation = db.name("eval")
    metrics = command.evaluate_statement(
        parse(
            f'SELECT * FROM {test_table} TO EVALUATE census_model WITH validation.metrics="Accuracy" '
            f"LABEL income INTO {evaluation}"
        ),
        db.url,
        models,
    )
    assert metrics["records"] == 500 and metrics["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    (row,) = rows_of(db, evaluation)
    assert row["accuracy"] == pytest.approx(accuracy, abs=1e-6) and row["records"] == 500

    again = parse(f"SELECT * FROM {test_table} TO PREDICT {pred}.income USING census_model")
    with pytest.raises(ConfigError, match=rf"TO PREDICT {pred}: the table exists; .*predict\.overwrite=true"):
        command.predict_statement(again, db.url, models)
    overwrite = parse(
        f"SELECT * FROM {test_table} WHERE age > 30 TO PREDICT {pred}.guess WITH predict.overwrite=true "
        "USING census_model"
    )
    count = command.predict_statement(overwrite, db.url, models)
    assert len(rows_of(db, pred)) == count < 500 and "guess" in rows_of(db, pred)[0]


def test_a_failing_predict_leaves_no_table(db: Tables, tmp_path: Path, monkeypatch) -> None:
    table = make_census(db, rows=300)
    models = str(tmp_path / "models")
    statement = parse(f"SELECT * FROM {table} TO TRAIN DNNClassifier LABEL income INTO m")
    train_here(
        command.plan_training(statement, db.url, models),
        db.url,
        f"SELECT * FROM {table}",
        f"{models}/m",
        epochs=1,
    )
    monkeypatch.setattr(command, "READ_RANGE", 100)
    calls = []
    original = command.ResultTable.insert

    def failing_insert(self, columns):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the database went away")
        original(self, columns)

    monkeypatch.setattr(command.ResultTable, "insert", failing_insert)
    pred = db.name("pred")
    with pytest.raises(RuntimeError, match="went away"):
        command.predict_statement(
            parse(f"SELECT * FROM {table} TO PREDICT {pred}.income USING m"), db.url, models
        )
    names = sa.inspect(db.engine).get_table_names()
    assert not [n for n in names if n.startswith(pred)]


def test_statement_errors_before_anything_starts(tmp_path: Path) -> None:
    tables = Tables(f"sqlite:///{tmp_path / 'c.db'}")
    table = make_census(tables, rows=50)
    models = str(tmp_path / "models")
    cases = {
        "WITH train.epochs=2 LABEL income": "TO TRAIN: unknown attribute train.epochs",
        "WITH model.hidden=[3] LABEL income": "TO TRAIN DNNClassifier: unknown attribute model.hidden",
        "LABEL salary": "LABEL: no column 'salary' in the SELECT",
        "COLUMN CATEGORY_ID(workclass, 2) LABEL income": "COLUMN: CATEGORY_ID(workclass, 2): the column has",
        "LABEL workclass": "LABEL workclass: a classifier's label must be an integer class id",
        'WITH validation.metrics="AUC" LABEL income': "WITH validation.metrics: 'AUC' is not one",
    }
    for clause, message in cases.items():
        statement = parse(f"SELECT * FROM {table} TO TRAIN DNNClassifier {clause} INTO m")
        with pytest.raises(ConfigError) as caught:
            command.plan_training(statement, tables.url, models)
        assert str(caught.value).startswith(message), str(caught.value)
    with pytest.raises(ConfigError, match="USING nothing: no model trained by TO TRAIN"):
        command.predict_statement(
            parse(f"SELECT * FROM {table} TO PREDICT p.x USING nothing"), tables.url, models
        )
    tables.drop_all()


@pytest.mark.parametrize(
    ("settings", "train_flags", "message"),
    [
        ("WITH train.epoch=0", "", "WITH train.epoch=0: 0 is less than 1"),
        ("WITH train.strategy=Sync", "", "WITH train.strategy=Sync: invalid choice: 'Sync'"),
        ("", "--num-workers abc", "--train-flags: argument --num-workers/--num_workers: 'abc' is not an"),
        ("", '"unclosed', '--train-flags: unrecognized arguments: "unclosed'),
        ("", "--outp x", "--train-flags: unrecognized arguments: --outp x"),
        ("", "-h", "--train-flags: unrecognized arguments: -h"),
        ("", "--yaml true", "--yaml prints Kubernetes manifests: it needs --backend kubernetes"),
    ],
)
def test_bad_training_settings_are_one_line_naming_what_the_statement_or_train_flags_said(
    capsys, tmp_path: Path, monkeypatch, settings: str, train_flags: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)  # where a misread relative --output would train
    tables = Tables(f"sqlite:///{tmp_path / 'c.db'}")
    table = make_census(tables, rows=50)
    models = tmp_path / "models"
    code, out, err = run_cli(
        capsys,
        "sql",
        "--db",
        tables.url,
        "--models",
        str(models),
        f"--train-flags={train_flags}",
        f"SELECT * FROM {table} TO TRAIN DNNClassifier {settings} LABEL income INTO m",
    )
    assert code == 2
    (line,) = error_lines(err)
    assert line.startswith(f"edl-argo sql: error: {message}"), err
    assert "usage" not in out + err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["c.db"]
    tables.drop_all()


def test_models_below_a_regular_file_is_one_line_before_anything_runs(capsys, tmp_path: Path) -> None:
    tables = Tables(f"sqlite:///{tmp_path / 'c.db'}")
    table = make_census(tables, rows=50)
    (tmp_path / "afile").write_text("mine")
    statement = f"SELECT * FROM {table} TO TRAIN DNNClassifier LABEL income INTO m"
    code, _, err = run_cli(capsys, "sql", "--db", tables.url, "--models", str(tmp_path / "afile"), statement)
    assert code == 2
    (line,) = error_lines(err)
    assert f"--models {tmp_path / 'afile' / 'm'}: {tmp_path / 'afile'} is a file, not a folder" in line, line
    assert (tmp_path / "afile").read_text() == "mine"
    tables.drop_all()


@pytest.mark.parametrize(
    ("settings", "train_flags", "message"),
    [
        ("", ["--output", "elsewhere"], "--train-flags --output: edl-argo sql sets --output itself"),
        ("", ["--output=elsewhere"], "--train-flags --output: edl-argo sql sets --output itself"),
        ("", ["--model_def", "m.py"], "--train-flags --model_def: edl-argo sql sets --model-def itself"),
        ("", ["--training-data", "d"], "--train-flags --training-data: edl-argo sql sets --training-data"),
        ("", ["--validation-data", "d"], "--train-flags --validation-data: edl-argo sql sets --validation"),
        ("", ["--data-format", "csv"], "--train-flags --data-format: edl-argo sql sets --data-format"),
        ("", ["--data-options", "key=id"], "--train-flags --data-options: edl-argo sql sets --data-options"),
        (
            "WITH train.workers=1",
            ["--num-workers", "2"],
            "--train-flags --num-workers: edl-argo sql sets --num-workers itself, from WITH train.workers",
        ),
    ],
)
def test_train_flags_that_sql_sets_itself_are_refused(
    tmp_path: Path, settings: str, train_flags: list[str], message: str
) -> None:
    tables = Tables(f"sqlite:///{tmp_path / 'c.db'}")
    table = make_census(tables, rows=50)
    statement = parse(f"SELECT * FROM {table} TO TRAIN DNNClassifier {settings} LABEL income INTO m")
    with pytest.raises(ConfigError) as caught:  # planned only: a flag let through would run a job
        command.plan_training(statement, tables.url, str(tmp_path / "models"), train_flags)
    assert str(caught.value).startswith(message), str(caught.value)
    tables.drop_all()


def test_train_flags_the_statement_leaves_open_are_taken(tmp_path: Path) -> None:
    tables = Tables(f"sqlite:///{tmp_path / 'c.db'}")
    table = make_census(tables, rows=50)
    statement = parse(f"SELECT * FROM {table} TO TRAIN DNNClassifier WITH train.epoch=3 LABEL income INTO m")
    plan = command.plan_training(statement, tables.url, str(tmp_path / "models"), ["--num-workers", "2"])
    assert (plan.args.num_workers, plan.args.num_epochs) == (2, 3)
    assert plan.args.output == str(tmp_path / "models" / "m")
    tables.drop_all()


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT * FROM t TO PREDICT p.income USING census_model",
        "SELECT * FROM t TO EVALUATE census_model LABEL income INTO e",
        "SELECT * FROM t TO TRAIN DNNClassifier LABEL income INTO m",
    ],
)
def test_a_statement_on_a_sqlite_database_that_is_not_there_makes_none(
    capsys, tmp_path: Path, statement: str
) -> None:
    missing = tmp_path / "nosuch.db"
    url = f"sqlite:///{missing}"
    code, _, err = run_cli(capsys, "sql", "--db", url, "--models", str(tmp_path / "models"), statement)
    assert code == 2
    (line,) = error_lines(err)
    assert line == f"edl-argo sql: error: --db {url}: no SQLite database at {missing}"
    assert list(tmp_path.iterdir()) == []
    code, out, _ = run_cli(capsys, "data", "census", "--db", url, "--table", "t", "--rows", "10")
    assert code == 0 and missing.exists(), out  # a command that writes a database makes it


def test_using_a_model_in_unreachable_storage_says_so_not_that_there_is_none(
    tmp_path: Path, monkeypatch
) -> None:
    tables = Tables(f"sqlite:///{tmp_path / 'c.db'}")
    table = make_census(tables, rows=10)
    monkeypatch.setenv("EDL_S3_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("EDL_STORAGE_RETRY_SECONDS", "1")
    statement = parse(f"SELECT * FROM {table} TO PREDICT p.income USING census_model")
    with pytest.raises(StorageError) as caught:
        command.predict_statement(statement, tables.url, "s3://bkt/models")
    assert str(caught.value).startswith("USING census_model: cannot reach S3 endpoint http://127.0.0.1:1")
    assert not has_table(tables, "p")
    tables.drop_all()


def test_to_train_runs_a_job(db: Tables, tmp_path: Path) -> None:
    table = make_census(db)
    models = str(tmp_path / "models")
    statement = parse(f"SELECT * FROM {table} TO TRAIN DNNClassifier WITH train.epoch=2 LABEL income INTO m")
    assert (
        command.run_train_statement(statement, db.url, models, ["--num-workers", "1", "--num-ps", "1"]) == 0
    )
    pred = db.name("pred")
    command.predict_statement(
        parse(f"SELECT * FROM {table} TO PREDICT {pred}.income USING m"), db.url, models
    )
    assert len(rows_of(db, pred)) == ROWS


@pytest.mark.parametrize(
    "command_line",
    [
        ["sql", "--db", "foo://x", "--models", "models", "SELECT * FROM t TO PREDICT p.income USING m"],
        ["sql", "--db", "foo://x", "--models", "models", "SELECT * FROM t TO TRAIN DNNClassifier INTO m"],
        ["data", "census", "--db", "foo://x", "--table", "t"],
    ],
)
def test_a_database_edl_argo_cannot_use_is_one_line_naming_db(
    capsys, tmp_path: Path, monkeypatch, command_line: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, *command_line)
    assert code == 2
    (line,) = error_lines(err)
    assert ": error: --db foo://x: unsupported database dialect 'foo'" in line, err
    assert list(tmp_path.iterdir()) == []
