"""How a job ends training: the pushes a synchronous step still waits for are applied once, by whichever of
the master's threads gets there first (the job's own, or a worker's GetTask after the last task), and every
caller returns only once the job knows the version they made."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edl_argo.master.job import TrainingJob
from edl_argo.master.job_parts import load_job_parts
from edl_argo.master.rendezvous import SILENT_AFTER_TRAINING_SECONDS, RendezvousManager
from edl_argo.pods import LocalProcessBackend
from edl_argo.proto import master_pb2
from edl_argo.rpc.auth import JobSecret
from edl_argo.worker import ps_client
from tests.engine_helpers import digits_config

#: The version the PS reaches by applying its pending push.
FINAL_VERSION = 18
#: How long a caller may take, at most, in this test.
WAIT_SECONDS = 10.0


def test_a_second_caller_of_the_end_of_training_returns_with_the_version_the_first_made(
    digits_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first caller applies the pending pushes; a second one, arriving while the first has not yet
    recorded the version they made, waits for it: the job's metrics are written right after its own call
    returns, and said ``model_version`` one short of the PS's when the other thread was first."""
    config = digits_config(digits_data, tmp_path / "job")
    job = TrainingJob(
        config, load_job_parts(config), LocalProcessBackend(config.job_name), JobSecret.generate()
    )
    job.versions.observe(FINAL_VERSION - 1)
    statuses = 0

    class FakeParameterServers:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def status(self, apply_pending: bool = False) -> list[Any]:
            nonlocal statuses
            statuses += 1
            return [SimpleNamespace(version=FINAL_VERSION, pending_applied=1)]

        def close(self) -> None:
            pass

    monkeypatch.setattr(ps_client, "ParameterServerClient", FakeParameterServers)
    monkeypatch.setattr(job, "_ps_addresses", lambda: "127.0.0.1:1")
    first_recording = threading.Event()
    let_it_record = threading.Event()
    record_version = job._on_version

    def slow_on_version(version: int) -> None:
        if threading.current_thread().name == "first":
            first_recording.set()
            assert let_it_record.wait(WAIT_SECONDS)
        record_version(version)

    monkeypatch.setattr(job, "_on_version", slow_on_version)
    first = threading.Thread(target=job._apply_pending_updates, name="first")
    first.start()
    assert first_recording.wait(WAIT_SECONDS)
    seen: list[int] = []
    second = threading.Thread(
        target=lambda: (job._apply_pending_updates(), seen.append(job.versions.version)), name="second"
    )
    second.start()
    second.join(0.5)
    let_it_record.set()
    first.join(WAIT_SECONDS)
    second.join(WAIT_SECONDS)
    assert not first.is_alive() and not second.is_alive()
    assert seen == [FINAL_VERSION]
    assert statuses == 1  # applied once


def test_at_the_end_of_training_a_member_found_silent_is_deleted_not_waited_for(
    digits_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group member its peer reported silent, that has not called since (SIGSTOPped), would never exit:
    the master deletes it as stuck once it has been silent for two watch intervals, instead of waiting out
    the exit grace; a reported member that called since is alive and left to exit on its own."""
    config = digits_config(digits_data, tmp_path / "job")
    job = TrainingJob(
        config, load_job_parts(config), LocalProcessBackend(config.job_name), JobSecret.generate()
    )
    clock = [1000.0]
    monkeypatch.setattr("edl_argo.master.rendezvous.time.monotonic", lambda: clock[0])
    rendezvous = RendezvousManager()
    for worker in (0, 1, 2):
        rendezvous.rendezvous(worker, f"w{worker}:1")
    first = rendezvous.current.round_id
    rendezvous.report_failure(reporter=0, round_id=first, suspect=1, message="silent")
    rendezvous.report_failure(reporter=0, round_id=first + 1, suspect=2, message="silent")
    rendezvous.rendezvous(2, "w2:1", master_pb2.RendezvousRequest(watch=True))
    deleted: dict[int, float] = {}
    live = {0, 1, 2}

    def wait_for_events(timeout: float) -> list[Any]:
        clock[0] += timeout
        return []

    def delete(worker: int) -> None:
        deleted[worker] = clock[0]
        live.discard(worker)

    job.rendezvous = rendezvous
    job.scaler = SimpleNamespace(tick=lambda: None)  # type: ignore[assignment]
    job.pods = SimpleNamespace(  # type: ignore[assignment]
        live_workers=live, restart_stuck_worker=delete, handle=lambda events: None
    )
    job.backend = SimpleNamespace(events=wait_for_events)  # type: ignore[assignment]
    job._wait_for_workers()
    assert list(deleted) == [1]
    assert 1000.0 + SILENT_AFTER_TRAINING_SECONDS < deleted[1] <= 1000.0 + SILENT_AFTER_TRAINING_SECONDS + 0.5
