"""The example pipelines, run end to end on this machine by ``edl-argo pipeline run``'s runner.

Small settings keep them at a minute or two each: the digits pipeline with its defaults (8 epochs),
data and artifacts in the S3 stand-in; the CTR pipeline with 2,500 records and two epochs, in local
folders (it also checks what only a sparse model shows: embedding rows trained on both PS shards); the
digits-formats pipeline on CSV (TFRecord and Parquet: slow, the reader tests cover them) and the census
SQL pipeline on SQLite, about 25 s each.

A run starts a warm server for its steps (``edl_argo.pods.warm.ScopedServer``): the digits pipeline checks
that its TensorFlow steps ran in it and that it is gone after the run; the CSV case runs cold
(``EDL_WARM=0``), as a step whose server could not start does.
"""

from __future__ import annotations

import json
from pathlib import Path

import keras
import numpy as np
import pytest
import sqlalchemy as sa

from edl_argo.pipeline.loader import load_workflow, with_parameters
from edl_argo.pipeline.runner import LocalRunner, Phase, RunResult
from edl_argo.pipeline.summary import summary
from edl_argo.pods.warm import socket_path
from edl_argo.storage import open_storage
from tests.engine_helpers import DIGITS_ACCURACY_FLOOR, assert_no_record_lost, master_port_turn
from tests.engine_helpers import model_dir as published_folder
from tests.manifests import ROOT
from tests.warm_log import WarmLog

PIPELINES = ROOT / "examples" / "pipelines"


def run_pipeline(name: str, workdir: Path, artifacts: str | None = None, **parameters: str) -> RunResult:
    workflow = with_parameters(load_workflow(PIPELINES / name), parameters)
    with master_port_turn():
        result = LocalRunner(workflow, workdir, artifacts).run()
    failed = result.failed
    assert failed is None, f"step {failed.name} failed: {failed.message}"
    return result


def test_digits_pipeline_reaches_095_with_data_and_artifacts_in_s3(
    s3_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDL_RUN_DIR", str(tmp_path / "run"))  # where the suite's warm server is not
    warm = WarmLog()
    result = run_pipeline("digits_pipeline.py", tmp_path, f"{s3_env}/artifacts", data=f"{s3_env}/digits")

    assert [(s.name, s.phase) for s in result.steps] == [
        ("prepare-digits", Phase.SUCCEEDED),
        ("elastic-train", Phase.SUCCEEDED),
        ("elastic-train.onExit", Phase.SUCCEEDED),  # the clean-up hook: nothing of the job is left
        ("evaluate", Phase.SUCCEEDED),
        ("predict", Phase.SUCCEEDED),
    ]
    evaluation = json.loads(result.step("evaluate").parameters["metrics"])
    assert evaluation["accuracy"] >= DIGITS_ACCURACY_FLOOR and evaluation["records"] == 360
    trained = json.loads(result.step("elastic-train").parameters["metrics"])
    assert abs(trained["accuracy"] - evaluation["accuracy"]) < 1e-6  # the evaluate step reproduces the job's

    model = result.step("elastic-train").artifacts["model"]
    assert model.startswith(s3_env) and open_storage(model).tree_complete("")  # a model tree, as published
    predictions = open_storage(result.step("predict").artifacts["predictions"])
    assert (
        sum(len(predictions.read(o.key).splitlines()) for o in predictions.list() if o.key.endswith(".jsonl"))
        == 360
    )
    done, total = (result.folder / "steps" / "elastic-train" / "progress").read_text().split("/")
    assert done == total and int(total) > 0  # what Argo would show as the step's progress

    text = summary(result)
    assert f"pipeline {result.workflow} succeeded" in text and f"artifact  model: {model}" in text

    # Its TensorFlow steps were forked from the server the run started, which it retired: it is gone.
    assert sorted(warm.commands()) == ["evaluate", "predict", "train"]
    assert not socket_path().exists()
    warm.wait_for("warm_server_idle")  # it exits as soon as nothing runs in it


@pytest.mark.slow  # 95 s; embeddings over two PS stay in make test through test_fit_parity
def test_ctr_pipeline_trains_embeddings_sharded_over_two_parameter_servers(tmp_path: Path) -> None:
    data = tmp_path / "ctr"
    result = run_pipeline(
        "ctr_pipeline.py", tmp_path / "runs", data=str(data), records="2500", epochs="2", workers="1"
    )

    assert [s.phase for s in result.steps] == [Phase.SUCCEEDED] * 4  # with the training's exit hook
    evaluation = json.loads(result.step("evaluate").parameters["metrics"])
    assert set(evaluation) == {"auc", "log_loss", "accuracy", "records"} and evaluation["records"] == 500
    artifact = Path(result.step("elastic-train").artifacts["model"])
    model_dir = published_folder(artifact.parent, artifact.name)  # the version its pointer names
    flags = json.loads((model_dir / "flags.json").read_text())
    assert flags["num_ps"] == 2 and flags["backend"] == "local"  # the runner's pods are local processes
    assert flags["training_data"] == f"{data}/train"
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert_no_record_lost(metrics)
    losses = metrics["training_loss_per_epoch"]
    assert losses["1"] < losses["0"], losses
    model = keras.models.load_model(model_dir / "model.keras", compile=False)
    tables = [layer.embeddings.numpy() for layer in model.layers if isinstance(layer, keras.layers.Embedding)]
    assert len(tables) == 26
    # Rows the job trained were exported from both parameter servers (even and odd ids).
    changed = np.flatnonzero(np.abs(tables[0]).max(axis=1) > 0.06)
    assert {0, 1} <= set(changed % 2)


@pytest.mark.parametrize(
    "fmt",
    [
        "csv",
        "images",  # PNG files in class folders: the job's tasks must each mix the classes to learn
        pytest.param("tfrecord", marks=pytest.mark.slow),
        pytest.param("parquet", marks=pytest.mark.slow),
    ],
)
def test_digits_formats_pipeline_trains_on_files_whose_format_it_detects(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if fmt == "csv":
        monkeypatch.setenv("EDL_WARM", "0")  # the steps run cold, each importing TensorFlow
    warm = WarmLog()
    data = tmp_path / "digits"
    result = run_pipeline("digits_formats_pipeline.py", tmp_path / "runs", format=fmt, data=str(data))
    assert len(warm.commands()) == (0 if fmt == "csv" else 2)  # train and evaluate

    assert [s.name for s in result.steps] == [
        "prepare-digits",
        "elastic-train",
        "elastic-train.onExit",
        "evaluate",
    ]
    files = [p for p in (data / "train").rglob("*") if p.is_file()]
    assert {p.suffix for p in files} == {".png" if fmt == "images" else f".{fmt}"}  # that format, no manifest
    evaluation = json.loads(result.step("evaluate").parameters["metrics"])
    assert evaluation["accuracy"] >= DIGITS_ACCURACY_FLOOR and evaluation["records"] == 360
    artifact = Path(result.step("elastic-train").artifacts["model"])
    flags = json.loads((published_folder(artifact.parent, artifact.name) / "flags.json").read_text())
    assert flags["data_format"] == ""  # detected, not given
    assert_no_record_lost(
        json.loads((published_folder(artifact.parent, artifact.name) / "metrics.json").read_text())
    )


def test_census_sql_pipeline_trains_predicts_and_evaluates_in_sqlite(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'census.db'}"
    result = run_pipeline(
        "census_sql_pipeline.py",
        tmp_path / "runs",
        db=db,
        models=str(tmp_path / "models"),
        **{"test-rows": "400"},
    )

    assert [s.name for s in result.steps] == ["census-train", "census-test", "train", "predict", "evaluate"]
    assert all(s.phase == Phase.SUCCEEDED for s in result.steps)
    engine = sa.create_engine(db)
    with engine.connect() as connection:
        truth = dict(connection.execute(sa.text("SELECT id, income FROM census_test")).all())
        predicted = dict(connection.execute(sa.text("SELECT id, income FROM census_pred")).all())
        (evaluation,) = connection.execute(sa.text("SELECT accuracy, records FROM census_eval")).all()
    engine.dispose()
    assert len(truth) == 400 and sorted(predicted) == sorted(truth)  # one prediction per test row
    accuracy = np.mean([predicted[i] == truth[i] for i in truth])
    assert accuracy >= 0.8, accuracy
    assert evaluation == (pytest.approx(accuracy, abs=1e-6), 400)  # TO EVALUATE agrees with the table
    assert (tmp_path / "models" / "census_model" / "sqlflow_model.py").is_file()
