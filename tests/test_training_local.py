"""End-to-end training jobs with the local pod backend: the engine's acceptance tests."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import keras
import numpy as np
import pytest

from edl_argo import cli, log
from edl_argo.data.commands import ctr_records, write_dataset
from edl_argo.master.config import TrainConfig
from edl_argo.master.job import TrainingJob
from edl_argo.pods import PodRole
from edl_argo.recordio import Compressor
from edl_argo.storage import LocalStorage
from tests.engine_helpers import (
    CTR_MODEL,
    DIGITS_MODEL,
    JobThread,
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

    assert metrics["final_metrics"]["accuracy"] >= 0.95
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
    assert metrics["final_metrics"]["accuracy"] >= 0.95
    assert_no_record_lost(metrics)


def test_worker_killed_mid_training_is_replaced_and_nothing_is_lost(
    digits_data: Path, tmp_path: Path, capfd
) -> None:
    job = TrainingJob(digits_config(digits_data, tmp_path / "job"))
    running = JobThread(job).start()
    running.wait_until(lambda: running.progress_fraction() >= 0.3, 240, "30% of the tasks")
    job.backend.kill(PodRole.WORKER, 0, signal.SIGKILL)
    metrics = running.join(300)

    assert metrics["relaunches"]["worker"] >= 1
    assert metrics["relaunches"]["events"][0]["old_id"] == 0
    assert metrics["task_requeues"]["worker_died"] >= 1
    assert_no_record_lost(metrics)
    assert metrics["final_metrics"]["accuracy"] >= 0.95
    assert read_metrics(tmp_path / "job")["relaunches"]["worker"] >= 1
    assert "worker_relaunched old_worker=0" in capfd.readouterr().err


def test_ps_killed_mid_training_restores_from_checkpoint(digits_data: Path, tmp_path: Path, capfd) -> None:
    job = TrainingJob(digits_config(digits_data, tmp_path / "job", checkpoint_steps=10))
    running = JobThread(job).start()
    running.wait_until(lambda: running.progress_fraction() >= 0.4, 240, "40% of the tasks")
    job.backend.kill(PodRole.PS, 0, signal.SIGKILL)
    metrics = running.join(300)

    assert metrics["relaunches"]["ps"] == 1
    assert_no_record_lost(metrics)
    assert metrics["final_metrics"]["accuracy"] >= 0.95
    assert "ps_restored" in capfd.readouterr().err


def test_scaling_one_to_three_to_one_worker(digits_data: Path, tmp_path: Path) -> None:
    job = TrainingJob(digits_config(digits_data, tmp_path / "job", num_workers=1, num_epochs=8))
    running = JobThread(job).start()
    running.wait_until(lambda: running.progress_fraction() >= 0.2, 240, "20% of the tasks")
    assert job.pods is not None
    job.pods.scale_workers(3)
    running.wait_until(lambda: len(job.pods.live_workers) == 3, 60, "three workers")
    running.wait_until(lambda: running.progress_fraction() >= 0.6, 240, "60% of the tasks")
    job.pods.scale_workers(1)
    running.wait_until(lambda: len(job.pods.live_workers) == 1, 60, "one worker again")
    metrics = running.join(300)

    assert_no_record_lost(metrics)
    assert metrics["final_metrics"]["accuracy"] >= 0.95
    assert metrics["relaunches"]["worker"] == 0


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
