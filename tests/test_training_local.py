"""End-to-end training jobs with the local pod backend: the engine's acceptance tests.

Jobs with faults (killed workers and PS, scaling, a hung worker, ...) are in tests/test_chaos.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import keras
import numpy as np
import pytest

from edl_argo import cli, log
from edl_argo.data.commands import ctr_records, write_dataset
from edl_argo.master.config import TrainConfig
from edl_argo.master.job import TrainingJob
from edl_argo.recordio import Compressor
from edl_argo.storage import LocalStorage
from tests.engine_helpers import (
    CTR_MODEL,
    DIGITS_ACCURACY_FLOOR,
    DIGITS_MODEL,
    assert_no_record_lost,
    digits_config,
    read_metrics,
)


@pytest.fixture(autouse=True)
def master_logs_to_stderr() -> None:
    """The master runs in the test process; send its event lines to stderr as `edl-argo train` does."""
    log.configure("INFO")


def test_sync_job_trains_digits_and_publishes_model(digits_data: Path, tmp_path: Path, capsys) -> None:
    output = tmp_path / "job"
    metrics = TrainingJob(digits_config(digits_data, output)).run()

    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    assert_no_record_lost(metrics)
    model_dir = output / "model"
    for name in ("saved_model/saved_model.pb", "model.keras", "metrics.json", "flags.json", "_COMPLETE"):
        assert (model_dir / name).exists(), name
    assert read_metrics(output)["final_metrics"] == metrics["final_metrics"]
    assert json.loads((model_dir / "flags.json").read_text())["num_workers"] == 2

    capsys.readouterr()
    args = ["--model", str(model_dir), "--model-def", DIGITS_MODEL, "--data", str(digits_data / "test")]
    assert cli.main(["evaluate", *args]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["accuracy"] == pytest.approx(metrics["final_metrics"]["accuracy"], abs=1e-6)

    predictions = tmp_path / "predictions"
    assert cli.main(["predict", *args, "--output", str(predictions)]) == 0
    lines = [
        json.loads(line) for f in sorted(predictions.rglob("*.jsonl")) for line in f.read_text().splitlines()
    ]
    assert len(lines) == int(evaluated["records"]) == 360
    assert {(p["shard"], p["record"]) for p in lines} == {(p["shard"], p["record"]) for p in lines} and len(
        {(p["shard"], p["record"]) for p in lines}
    ) == 360
    assert all(len(p["output"]) == 10 for p in lines)


def test_async_job_trains_digits(digits_data: Path, tmp_path: Path) -> None:
    metrics = TrainingJob(digits_config(digits_data, tmp_path / "job", use_async=True)).run()
    assert metrics["final_metrics"]["accuracy"] >= DIGITS_ACCURACY_FLOOR
    assert_no_record_lost(metrics)


def test_ctr_model_trains_with_two_parameter_servers(tmp_path: Path) -> None:
    data = LocalStorage(tmp_path / "ctr")
    write_dataset(data, "train", ctr_records(3000, 100_000, seed=0), 2, Compressor.SNAPPY, overwrite=False)
    config = TrainConfig(
        model_def=CTR_MODEL,
        training_data=str(tmp_path / "ctr" / "train"),
        output=str(tmp_path / "job"),
        job_name="test-ctr",
        num_epochs=2,
        minibatch_size=64,
        num_minibatches_per_task=8,
        num_workers=2,
        num_ps=2,
    )
    metrics = TrainingJob(config).run()

    assert_no_record_lost(metrics)
    losses = metrics["training_loss_per_epoch"]
    assert losses["1"] < losses["0"], losses
    model = keras.models.load_model(tmp_path / "job" / "model" / "model.keras", compile=False)
    tables = [layer.embeddings.numpy() for layer in model.layers if isinstance(layer, keras.layers.Embedding)]
    assert len(tables) == 26
    # Rows the job trained were exported from both parameter servers (even and odd ids).
    changed = np.flatnonzero(np.abs(tables[0]).max(axis=1) > 0.06)
    assert {0, 1} <= set(changed % 2)
