"""A job whose model cannot be published keeps it, and the next run of the job publishes it untrained."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from edl_argo import log
from edl_argo.errors import JobFailedError, StorageError
from edl_argo.master.config import TrainConfig
from edl_argo.master.export import KEPT_MODEL_KEY, MODEL_KEY
from edl_argo.master.job import TrainingJob
from edl_argo.master.pod_manager import PodManager
from edl_argo.master.state_store import STATE_KEY
from edl_argo.storage import LocalStorage
from tests.engine_helpers import digits_config, model_dir, read_metrics


@pytest.fixture(autouse=True)
def master_logs_to_stderr() -> None:
    log.configure("INFO")


def small_job(digits_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TrainConfig:
    """One epoch, one worker, its own pods folder (whatever runs beside) and master state under tmp_path."""
    monkeypatch.setenv("EDL_RUN_DIR", str(tmp_path / "run"))
    return digits_config(
        digits_data,
        tmp_path / "job",
        num_epochs=1,
        num_workers=1,
        shuffle=False,
        master_state=str(tmp_path / "state"),
        job_name=f"publish-{uuid.uuid4().hex[:8]}",
    )


def test_a_model_that_cannot_be_published_is_kept_and_published_by_the_next_run(
    digits_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = small_job(digits_data, tmp_path, monkeypatch)
    output, state = Path(config.output), Path(config.master_state)
    put_tree = LocalStorage.put_tree

    def store_down_for_output(storage: LocalStorage, local_dir: Path, key: str) -> None:
        if storage.root == output:
            raise StorageError(f"cannot reach {storage.describe(key)}: the store is down (injected)")
        put_tree(storage, local_dir, key)

    monkeypatch.setattr(LocalStorage, "put_tree", store_down_for_output)
    with pytest.raises(JobFailedError, match=r"kept at .*run the job again") as failure:
        TrainingJob.load(config).run()

    assert failure.value.exit_code == 1
    assert not (output / MODEL_KEY).exists()
    kept = state / KEPT_MODEL_KEY
    assert (
        LocalStorage(state).tree_complete(KEPT_MODEL_KEY)
        and (model_dir(kept.parent, kept.name) / "model.keras").is_file()
    )
    assert (state / STATE_KEY).is_file()
    kept_metrics = json.loads((model_dir(kept.parent, kept.name) / "metrics.json").read_text())

    monkeypatch.setattr(LocalStorage, "put_tree", put_tree)
    monkeypatch.setattr(PodManager, "start", lambda self: pytest.fail("the job trained again"))
    metrics = TrainingJob.load(config).run()

    assert metrics == kept_metrics and metrics["final_metrics"]["accuracy"] > 0.5
    assert read_metrics(output) == kept_metrics
    assert LocalStorage(output).tree_complete(MODEL_KEY) and (model_dir(output) / "saved_model").is_dir()
    assert not any(path.is_file() for path in kept.rglob("*"))
    assert not (state / STATE_KEY).exists()


def test_storage_failing_while_the_job_runs_exits_1_and_keeps_the_state(
    digits_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = small_job(digits_data, tmp_path, monkeypatch)

    def unreachable(job: TrainingJob) -> None:
        raise StorageError(f"cannot reach {config.training_data}: the store is down (injected)")

    monkeypatch.setattr(TrainingJob, "_sample_features", unreachable)  # read when exporting
    with pytest.raises(JobFailedError, match="failed while running: cannot reach") as failure:
        TrainingJob.load(config).run()

    assert failure.value.exit_code == 1
    assert (Path(config.master_state) / STATE_KEY).is_file()
    assert not (Path(config.output) / MODEL_KEY).exists()
