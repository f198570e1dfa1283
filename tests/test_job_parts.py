"""A training job is built from parts read beforehand (edl_argo/master/job_parts.py): no I/O in its
constructor, and bad input fails while the parts are read, before any backend exists."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from edl_argo.errors import DataFormatError
from edl_argo.master import job as job_module
from edl_argo.master.failover import STATE_PARTS
from edl_argo.master.job import TrainingJob
from edl_argo.master.job_parts import load_job_parts
from edl_argo.pods import LocalProcessBackend
from edl_argo.rpc.auth import JobSecret
from tests.engine_helpers import digits_config


def test_a_job_is_built_from_its_parts_without_reading_anything(
    digits_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = digits_config(digits_data, tmp_path / "job")
    parts = load_job_parts(config)

    def no_io(*args: object, **kwargs: object) -> None:
        raise AssertionError("the constructor did I/O")

    for name in ("open_data",):
        monkeypatch.setattr(job_module, name, no_io)
    elsewhere = dataclasses.replace(
        config, training_data=str(tmp_path / "gone"), output=str(tmp_path / "out")
    )
    job = TrainingJob(elsewhere, parts, LocalProcessBackend(config.job_name), JobSecret.generate())
    assert job.training_shards == parts.training_data.records and job.spec is parts.spec
    assert job.ps_ports == parts.ps_ports and job.output is parts.output
    assert not (tmp_path / "gone").exists() and not (tmp_path / "out").exists()


def test_a_corrupt_saved_state_fails_before_any_backend_exists(
    digits_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = digits_config(digits_data, tmp_path / "job")
    store = load_job_parts(config).state_store
    store.save({part: {} for part in STATE_PARTS} | {"dispatcher": {"format": 1, "doing": "not tasks"}})

    def no_backend(*args: object) -> None:
        raise AssertionError("a backend was made for a job that cannot start")

    monkeypatch.setattr(job_module, "default_backend", no_backend)
    with pytest.raises(DataFormatError, match=r"cannot be restored \(dispatcher: "):
        TrainingJob.load(config)
